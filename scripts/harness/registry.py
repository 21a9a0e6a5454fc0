"""The subcommands of every scripts folder, and the dispatcher of ``python -m scripts.<folder>``.

Each folder's ``__main__.py`` calls :func:`main` with its name: ``python -m scripts.bench init
--worlds 4096`` imports the module of ``init`` and calls its ``main(["--worlds", "4096"])``.
Modules are imported by name only when their command runs (nothing here imports torch), so
listing the commands is instant and a benchmark that times imports starts clean.

The old per-module entry points (``python -m scripts.bench.init``) end in :func:`moved`: it
names the new command on stderr and exits 2.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, cast


@dataclass(frozen=True)
class Command:
    """One subcommand: ``python -m scripts.<folder> <name> [ARGS]`` runs ``<module>.main(ARGS)``.

    Attributes:
        name: the subcommand's name.
        module: the module whose ``main(argv)`` runs it.
        claim: what it shows, in one line.
        example: arguments of the example command in scripts/README.md ("" for none).
        also: further example commands, written out (e.g. under torchrun).
    """

    name: str
    module: str
    claim: str
    example: str = ""
    also: tuple[str, ...] = ()


def _commands(*commands: Command) -> dict[str, Command]:
    return {c.name: c for c in commands}


#: folder -> its subcommands by name, in the order they are listed.
FOLDERS: dict[str, dict[str, Command]] = {
    "examples": _commands(
        Command(
            "demo",
            "scripts.examples.demo",
            "every Megatron-Core kind of process group on 8 CPU processes, each checked by an all-reduce; "
            "under torchrun or srun each process is one rank of the launcher's world (NCCL on "
            "`cuda:LOCAL_RANK` where CUDA is available, gloo otherwise; `--bind-device`: the default group "
            "bound to the device)",
            also=("torchrun --nproc-per-node 4 -m scripts.examples demo --tp 2 --dp 2 --pp 1 --ep 1",),
        ),
        Command(
            "hang",
            "scripts.examples.hang",
            "a hang named live and offline: 8 gloo ranks in Megatron's layout, one stalls (`--case` tp, pp, dp, ep, "
            "loader, mismatch); the hang watch's report, then `parallel-state-ng diagnose` on its dumps",
            "--case pp",
        ),
        Command(
            "train_gpt",
            "scripts.examples.train_gpt",
            "Megatron's GPT trained on CPU processes under MCore or compat (`--loop training`: Megatron-LM's "
            "`pretrain`); under torchrun or srun each process is one rank of the launcher's world",
            "--impl compat --tp 2 --pp 2 --dp 2",
        ),
        Command(
            "restart_gpt",
            "scripts.examples.restart_gpt",
            "a rank killed mid-training; the survivors rebuild at a smaller dp in the same processes",
        ),
        Command(
            "two_modules",
            "scripts.examples.two_modules",
            "two modules wired by Megatron 0.19's bridge communicators, from our topology or by hand",
            "--megatron-path DIR",
        ),
        Command(
            "verify_job",
            "scripts.examples.verify_job",
            "a job's start-up check: compat's groups pass `verify_groups`, a hand-assembled collection "
            "(cp unset, the world as mp) fails on every rank",
        ),
        Command(
            "train_and_infer",
            "scripts.examples.train_and_infer",
            "an RL-shaped job: train tp2 pp2 dp2 from `build_megatron_groups`, infer tp4 pp1 on the same ranks "
            "(`build_inference_collection`): logits vs a one-rank model, communicators per rank, the training "
            "groups the inference does not borrow asleep meanwhile, step 3 bit-identical to a run without "
            "inference; then `--cycles` sleep/wake cycles counted for leaks (threads, sockets, descriptors, groups)",
            "--megatron-path DIR",
        ),
        Command(
            "inprocess_restart",
            "scripts.examples.inprocess_restart",
            "nvidia-resiliency-ext's in-process restart on CPU, with compat or MCore",
            "--impl compat --nvrx-path DIR",
        ),
        Command(
            "release_pairs",
            "scripts.examples.release_pairs",
            "which group kinds change between megatron-core releases for five 8-rank configurations "
            "(`layout --diff`), as a table",
        ),
    ),
    "bench": _commands(
        Command(
            "init",
            "scripts.bench.init.cost",
            "per-rank cost (time, memory) of `initialize_model_parallel` on one simulated rank: MCore vs "
            "compat vs the floor",
        ),
        Command(
            "world_init",
            "scripts.bench.world_init",
            "job init time on real gloo worlds: MCore vs compat (with and without sharing) vs the floor",
        ),
        Command(
            "count_init_calls",
            "scripts.bench.count_init_calls",
            "exact Python call counts of one rank's init by part, against the floor",
        ),
        Command(
            "phases",
            "scripts.bench.phases",
            "time to usable groups phase by phase, compat (member and split path) and MCore in one world, "
            "and a scale model to 1,024 and 65,536 ranks (`--launcher gpu`: the one-GPU NCCL world)",
            "--worlds 4,8 --rounds 1",
        ),
        Command(
            "store_traffic",
            "scripts.bench.store_traffic",
            "store operations of one init per rank: compat (member and split path) against MCore, through a "
            "`FileStore` and a `TCPStore`",
            "--worlds 4,8 --rounds 1",
        ),
        Command("agreement", "scripts.bench.agreement", "cost of the cross-rank agreement check"),
        Command(
            "hang_watch",
            "scripts.bench.hang_watch",
            "what the hang watch costs each collective: an all-reduce with and without it, simulated and gloo",
            "--ops 5000 --gloo-ops 500 --rounds 3",
        ),
        Command(
            "collection",
            "scripts.bench.collection",
            "one module's full `ProcessGroupCollection` on one simulated rank: ours vs Megatron's grids vs the floor",
        ),
        Command(
            "inference",
            "scripts.bench.inference",
            "Megatron 0.19's inference collection and shards on one simulated rank of 65,536: ours vs "
            "Megatron's own functions, `new_group` calls, speed-up",
            "--megatron-path DIR",
        ),
        Command(
            "registry",
            "scripts.bench.registry",
            "communicators per rank for a training and an inference layout in one process at 65,536 simulated "
            "ranks, `PSNG_SHARE_GROUPS` 0 / 1 / process",
        ),
        Command(
            "layout",
            "scripts.bench.layout",
            "layout enumeration: `Layout` vs Megatron-Core's `RankGenerator` / `HyperCommGrid`",
        ),
        Command(
            "split",
            "scripts.bench.split",
            "the split path at 4,096 and 65,536 simulated ranks: splits per rank, Python time against bare "
            "`split_group` calls, MCore's `new_group` calls",
        ),
        Command(
            "nvlink_table",
            "scripts.bench.nvlink_table",
            "NVLink-domain crossings of published NVL72 shapes, before/after the suggested order "
            "(docs/results/nvlink.md)",
        ),
        Command(
            "failure_table",
            "scripts.bench.failure_table",
            "a rank dies while groups are created: what the survivors see",
        ),
    ),
    "matrix": _commands(
        Command(
            "torch_matrix",
            "scripts.matrix.torch_matrix",
            "the fast and multiprocess subsets and the demo on each torch release, one venv each (torch "
            "pinned), as a table (docs/results/torch.md)",
            "2.14.1 2.4.1",
        ),
        Command(
            "megatron_unit_tests",
            "scripts.matrix.megatron_unit_tests",
            "a Megatron-LM checkout's own `tests/unit_tests/test_parallel_state.py` (nothing copied, nothing "
            "changed) on CPU gloo ranks, under MCore, compat, compat with `PSNG_SHARE_GROUPS=safe` and `1`: "
            "outcome counts per setting, every test whose outcome differs; exit 1 when mcore / compat / safe "
            'disagree, 2 on bad input (docs/results/compat.md, "Megatron\'s own `test_parallel_state.py`")',
            "--tests-dir ~/Megatron-LM/tests/unit_tests --nproc 8 [--megatron-path DIR] [-k EXPR]",
        ),
    ),
    "gpu": _commands(
        Command(
            "check",
            "scripts.gpu.check",
            "world size 1 NCCL, lazy and device-bound: creation path, NCCL options against MCore, GPT steps "
            "bit-identical to MCore on CUDA, destroy; the N-rank worlds on one GPU (`--world-checks`); then "
            "the fast tests",
            "--cpu-dry-run --no-tests",
        ),
        Command(
            "split_share",
            "scripts.gpu.split_share",
            "what NCCL's split sharing saves in the one-GPU world: the same init with and without it",
            "--cpu-dry-run --world 4 --layout tp2-pp2",
        ),
        Command(
            "world",
            "scripts.gpu.world",
            "N ranks on one GPU, a real NCCL world of N processes sharing `cuda:0`: one all-reduce per rank, printed",
            "--size 8 --mode bound",
        ),
    ),
}


def command_line(folder: str, name: str) -> str:
    """``python -m scripts.<folder> <name>``: how a subcommand is run."""
    return f"python -m scripts.{folder} {name}"


def listing(folder: str) -> str:
    """The usage line and every subcommand of ``folder`` with its claim, one per line."""
    commands = FOLDERS[folder]
    width = max(len(name) for name in commands)
    lines = [f"usage: python -m scripts.{folder} NAME [ARGS]   (NAME --help: its options)", "", "commands:"]
    lines += [f"  {c.name:<{width}}  {c.claim.replace('`', '')}" for c in commands.values()]
    return "\n".join(lines) + "\n"


def entry(folder: str, name: str) -> Callable[[list[str]], int | None]:
    """The ``main(argv)`` of subcommand ``name`` of ``folder`` (its module imported now).

    Raises:
        KeyError: no such folder or subcommand.
    """
    module = importlib.import_module(FOLDERS[folder][name].module)
    return cast(Callable[[list[str]], "int | None"], module.main)


def main(folder: str, argv: Sequence[str] | None = None) -> int:
    """Run ``python -m scripts.<folder> NAME [ARGS]``; return the exit status.

    No name: the list of commands on stderr, status 2; ``-h`` / ``--help``: the list on stdout,
    status 0; an unknown name: an error naming it and the valid names, status 2. While the
    command runs, ``sys.argv[0]`` is ``python -m scripts.<folder> NAME`` (its parser's usage line).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write(listing(folder))
        return 2
    if args[0] in ("-h", "--help"):
        sys.stdout.write(listing(folder))
        return 0
    name, rest = args[0], args[1:]
    if name not in FOLDERS[folder]:
        valid = ", ".join(FOLDERS[folder])
        print(f"python -m scripts.{folder}: error: unknown command {name!r}; valid commands: {valid}", file=sys.stderr)
        return 2
    run = entry(folder, name)
    saved = sys.argv[0] if sys.argv else ""
    if sys.argv:
        sys.argv[0] = command_line(folder, name)
    try:
        status = run(rest)
    finally:
        if sys.argv:
            sys.argv[0] = saved
    return 0 if status is None else int(status)


def moved(folder: str, name: str) -> NoReturn:
    """The end of an old entry point ``python -m scripts.<folder>.<module>``: name the new
    command on stderr and exit 2.
    """
    if name not in FOLDERS[folder]:
        raise KeyError(f"no command {name!r} in scripts/{folder}")
    print(f"this module is no longer an entry point; run: {command_line(folder, name)}", file=sys.stderr)
    raise SystemExit(2)
