"""Demo of parallel_state_ng: real process groups in a world of CPU processes, each checked.

One process per rank (forked from a server that has imported torch) joins a gloo world, creates
its own group of every kind Megatron-Core's ``initialize_model_parallel`` builds and all-reduces
a one-hot vector of its rank over each (steps: :func:`_check_groups`); rank 0 prints each kind's
groups and checks every rank saw exactly its group's members. Started by a launcher (torchrun,
srun: :mod:`scripts.examples.launcher`), every process joins the launcher's world instead, NCCL
on ``cuda:LOCAL_RANK`` where CUDA is available, gloo otherwise; its size must be the layout's.
Exit code 0 when all groups are verified, 1 when a check fails, 2 for bad options.
Commands: scripts/README.md; options: ``--help``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

# torch warns once per process when numpy is absent; the demo needs only torch.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

DENSE_TOKENS = ("tp", "cp", "dp", "pp")
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
EXPERT_NAME = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
MAX_WORLD_SIZE = 64
EXPERT_VIEW = "expert"

# (label, view, dims): the groups Megatron-Core's initialize_model_parallel creates.
GROUP_KINDS = [
    ("tensor parallel", None, ["tp"]),
    ("context parallel", None, ["cp"]),
    ("data parallel", None, ["dp"]),
    ("data parallel with context parallel", None, ["cp", "dp"]),
    ("pipeline parallel", None, ["pp"]),
    ("model parallel (tensor + pipeline)", None, ["tp", "pp"]),
    ("tensor + context parallel", None, ["tp", "cp"]),
    ("tensor + data parallel", None, ["tp", "dp"]),
    ("tensor + data + context parallel", None, ["tp", "cp", "dp"]),
    ("expert tensor parallel", EXPERT_VIEW, ["etp"]),
    ("expert model parallel", EXPERT_VIEW, ["ep"]),
    ("expert tensor + model parallel", EXPERT_VIEW, ["etp", "ep"]),
    ("expert tensor + model + pipeline parallel", EXPERT_VIEW, ["etp", "ep", "pp"]),
    ("expert data parallel", EXPERT_VIEW, ["edp"]),
]


class DemoOptionError(ValueError):
    """A combination of options that does not describe a valid layout."""


@dataclass
class DemoConfig:
    """The validated layout of the demo."""

    sizes: dict[str, int]  # tp, cp, dp, pp, ep, etp, edp
    dense_order: list[str]  # tp/cp/dp/pp, first fastest
    expert_order: list[str]  # etp/ep/edp/pp, first fastest
    world_size: int
    ep_placed: bool = False  # ep was not in --order and was put before dp
    bind_device: bool = False  # --bind-device: the launcher's default group bound to the device
    kinds: list[tuple[str, str | None, list[str]]] = field(default_factory=list)

    @property
    def grid_size(self) -> int:
        """Ranks in the dense grid (the product of its sizes)."""
        return math.prod(self.sizes[t] for t in DENSE_TOKENS)

    @property
    def shared_dims(self) -> list[str]:
        """Dims the expert view shares with the dense layout (pp, when it is a dense dim)."""
        return ["pp"] if "pp" in self.dense_order else []

    @property
    def dense_shape(self) -> list[int]:
        """Sizes of the dense layout's dims, in its order."""
        return [self.sizes[t] for t in self.dense_order]

    @property
    def expert_shape(self) -> list[int]:
        """Sizes of the expert view's dims, in its order."""
        return [self.sizes[t] for t in self.expert_order]


# ------------------------------------------------------------------------ options


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.examples demo",
        description="Create every Megatron-Core kind of process group with parallel_state_ng in a "
        "world of CPU processes (gloo) and check each group with a real all-reduce.",
    )
    parser.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=_positive_int, default=2, help="pipeline-parallel size (default 2)")
    parser.add_argument("--dp", type=_positive_int, default=2, help="data-parallel size (default 2)")
    parser.add_argument("--cp", type=_positive_int, default=1, help="context-parallel size (default 1)")
    parser.add_argument("--ep", type=_positive_int, default=2, help="expert-parallel size (default 2)")
    parser.add_argument(
        "--etp",
        type=_positive_int,
        default=None,
        help="expert tensor-parallel size (default: --tp, as in Megatron-Core)",
    )
    parser.add_argument(
        "--order",
        default="tp-dp-pp",
        help="dim order, first varies fastest, tokens from tp/cp/ep/dp/pp (default tp-dp-pp); "
        "dims of size 1 may be left out; ep only orders the expert layout",
    )
    parser.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        help=f"number of processes (default tp*cp*dp*pp; more leaves ranks outside the grid; at most {MAX_WORLD_SIZE})",
    )
    parser.add_argument(
        "--bind-device",
        action="store_true",
        help="under a launcher with CUDA: bind the default group to cuda:LOCAL_RANK (eager init; torch then "
        "creates every group by splitting it)",
    )
    return parser


def make_config(args: argparse.Namespace) -> DemoConfig:
    """Check the options together and derive the layouts; raises :class:`DemoOptionError`."""
    sizes = {"tp": args.tp, "cp": args.cp, "dp": args.dp, "pp": args.pp, "ep": args.ep}
    sizes["etp"] = args.tp if args.etp is None else args.etp
    tokens = [t.strip().lower() for t in args.order.split("-")]
    unknown = [t for t in tokens if t not in ORDER_TOKENS]
    if unknown or not args.order.strip():
        raise DemoOptionError(
            f"--order {args.order!r}: unknown token(s) {unknown}; use tokens from {'-'.join(ORDER_TOKENS)}"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise DemoOptionError(f"--order {args.order!r} repeats {repeated}")
    missing = [t for t in DENSE_TOKENS if t not in tokens and sizes[t] > 1]
    if missing:
        raise DemoOptionError(
            f"--order {args.order!r} leaves out {', '.join(f'{t} (size {sizes[t]})' for t in missing)}; "
            "only dims of size 1 may be left out"
        )
    dense_order = [t for t in tokens if t != "ep"]  # dims left out have size 1: no dim needed
    full_order = dense_order + [t for t in DENSE_TOKENS if t not in tokens]  # MCore appends them
    grid_size = math.prod(sizes[t] for t in DENSE_TOKENS)

    world_size = grid_size if args.world_size is None else args.world_size
    if world_size < grid_size:
        raise DemoOptionError(f"--world-size {world_size} is smaller than the grid: tp*cp*dp*pp = {grid_size}")
    if world_size > MAX_WORLD_SIZE:
        raise DemoOptionError(
            f"a world of {world_size} processes is too large for this demo (at most {MAX_WORLD_SIZE} CPU processes)"
        )

    expert_model = sizes["etp"] * sizes["ep"] * sizes["pp"]
    if grid_size % expert_model:
        raise DemoOptionError(
            f"expert layout: etp*ep*pp = {sizes['etp']}*{sizes['ep']}*{sizes['pp']} = {expert_model} "
            f"does not divide the grid's {grid_size} ranks "
            f"(--etp {sizes['etp']}, --ep {sizes['ep']}, --pp {sizes['pp']})"
        )
    sizes["edp"] = grid_size // expert_model
    expert_tokens = [t for t in full_order if t != "cp"]  # all four expert dims, even of size 1
    ep_placed = "ep" not in tokens
    if ep_placed:  # where Megatron-Core's default order tp-cp-ep-dp-pp puts it: before dp
        expert_tokens.insert(expert_tokens.index("dp"), "ep")
    else:
        expert_tokens.insert(sum(1 for t in tokens[: tokens.index("ep")] if t in expert_tokens), "ep")
    expert_order = [EXPERT_NAME[t] for t in expert_tokens]
    all_sizes = dict(sizes)
    config = DemoConfig(all_sizes, dense_order, expert_order, world_size, ep_placed, args.bind_device)
    config.kinds = _kinds(config)
    _check_shared_pipeline(config)
    return config


def _kinds(config: DemoConfig) -> list[tuple[str, str | None, list[str]]]:
    """The group kinds to create: size-1 dims dropped, kinds that then coincide listed once.

    When every dim has size 1 the tensor-parallel kind stays (groups of one rank), so that a
    world of single-rank groups still creates and checks groups.
    """
    if all(config.sizes[d] == 1 for _, _, dims in GROUP_KINDS for d in dims):
        return [GROUP_KINDS[0]]
    kinds, seen = [], set()
    for label, view, dims in GROUP_KINDS:
        reduced = [d for d in dims if config.sizes[d] > 1]
        key = (view, frozenset(reduced))
        if not reduced or key in seen:
            continue
        seen.add(key)
        kinds.append((label, view, reduced))
    return kinds


def _check_shared_pipeline(config: DemoConfig) -> None:
    """Megatron-Core requires the expert layout's pp groups to be the dense ones."""
    from parallel_state_ng import Layout

    if not config.shared_dims:
        return  # pp of size 1, left out of --order: nothing to share
    dense = Layout(config.dense_shape, config.dense_order)
    expert = Layout(config.expert_shape, config.expert_order)
    if not dense.same_groups("pp", expert):
        raise DemoOptionError(
            f"the expert layout {'-'.join(config.expert_order)} ({_dims_text(config, config.expert_order)}) "
            f"puts its pipeline groups on other ranks than the dense layout {'-'.join(config.dense_order)} "
            f"(dense pp group of rank 0: {dense.group_ranks(0, 'pp')}, expert: {expert.group_ranks(0, 'pp')}); "
            "change --order or --etp/--ep so that the dims before pp hold the same number of ranks"
        )


def _dims_text(config: DemoConfig, names: Sequence[str]) -> str:
    return " ".join(f"{n}={config.sizes[n]}" for n in names)


# ------------------------------------------------------------------- per rank


def _rank_main(rank: int, config: DemoConfig, store_path: str) -> None:
    """One process of the world the demo starts: join it through a ``FileStore``, then :func:`_check_groups`."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.FileStore(store_path, config.world_size)
    dist.init_process_group(
        "gloo", rank=rank, world_size=config.world_size, store=store, timeout=datetime.timedelta(seconds=120)
    )
    try:
        report = _check_groups(rank, config, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    if report is not None:
        print(report[0], flush=True)
        if not report[1]:
            raise SystemExit(1)


def _check_groups(rank: int, config: DemoConfig, device, setting: str = "") -> tuple[str, bool] | None:
    """Create and check the groups on this rank of the initialized world; rank 0's report and verdict.

    1. builds a :class:`parallel_state_ng.HyperCommGrid` for the dense layout (tp, cp, dp, pp in
       ``--order``; the first dim varies fastest, as in Megatron-Core) and registers the expert
       layout (etp, ep, edp, pp) as a view that shares the pipeline dim;
    2. creates its own group of every kind (only the calling rank's group, with local
       synchronization);
    3. all-reduces a one-hot vector of its rank over each group on ``device``: the result shows
       exactly which ranks answered; the results are gathered on every rank (None elsewhere
       than rank 0). ``setting`` replaces the report's "CPU processes, gloo on this machine".
    """
    import torch
    import torch.distributed as dist

    from parallel_state_ng import HyperCommGrid

    grid = HyperCommGrid(config.dense_shape, config.dense_order)
    try:
        grid.register_view(EXPERT_VIEW, config.expert_shape, config.expert_order, shared_dims=config.shared_dims)
        # one row per kind: the all-reduced one-hot vector, or -1 everywhere outside the grid
        seen = torch.full((len(config.kinds), config.world_size), -1, dtype=torch.int64, device=device)
        for k, (label, view, dims) in enumerate(config.kinds):
            pg = grid.create_pg(dims, view=view, group_desc=label.upper().replace(" ", "_"))
            if pg is None:  # outside the grid: no group, no call
                continue
            one_hot = torch.zeros(config.world_size, dtype=torch.int64, device=device)
            one_hot[rank] = 1
            dist.all_reduce(one_hot, group=pg)
            seen[k] = one_hot
        # a tensor on the world's device: NCCL gathers no CPU objects
        gathered = [torch.empty_like(seen) for _ in range(config.world_size)]
        dist.all_gather(gathered, seen)
        if rank != 0:
            return None
        by_rank = [
            [None if int(row[0]) < 0 else row.nonzero().flatten().tolist() for row in rows.cpu()] for rows in gathered
        ]
        return _report(config, grid, by_rank, setting)
    finally:
        grid.destroy()


def _wrap_groups(groups: list[list[int]], width: int = 96) -> str:
    text = " ".join(str(g) for g in groups)
    return textwrap.fill(text, width=width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)


def _report(config: DemoConfig, grid, seen_by_rank: list, setting: str = "") -> tuple[str, bool]:
    """The printed report (rank 0) and whether every group checked out."""
    lines = [
        f"parallel_state_ng demo: {config.world_size} {setting or 'CPU processes, gloo on this machine'}",
        f"dense layout:  {_dims_text(config, config.dense_order)}  "
        f"(order {'-'.join(config.dense_order)}, first varies fastest)",
        f"expert layout: {_dims_text(config, config.expert_order)}  (order {'-'.join(config.expert_order)}, "
        f"{'pp shared with the dense layout' if config.shared_dims else 'pp of size 1'}"
        f"{'; ep placed before edp' if config.ep_placed else ''})",
    ]
    outside = config.world_size - config.grid_size
    if outside == 1:
        lines.append(f"rank {config.grid_size} is outside the grid: it gets no group and makes no call")
    elif outside > 1:
        lines.append(
            f"ranks {config.grid_size}..{config.world_size - 1} are outside the grid: "
            "they get no group and make no call"
        )
    left_out = len(GROUP_KINDS) - len(config.kinds)
    if left_out:
        lines.append(
            f"{left_out} of Megatron-Core's {len(GROUP_KINDS)} kinds left out: with size-1 dims dropped they are "
            "single ranks or repeat a kind shown"
        )
    lines.append("")
    failures, verified = [], 0
    for k, (label, view, dims) in enumerate(config.kinds):
        groups = grid.get_rank_enum(dims, view=view)
        dims_text = "-".join(dims) + (f" in the {view} view" if view else "")
        lines.append(f"{label} [{dims_text}]: {len(groups)} group{'s' if len(groups) != 1 else ''} of {len(groups[0])}")
        lines.append(_wrap_groups(groups))
        group_of = {r: g for g in groups for r in g}
        kind_ok = True
        for rank in range(config.world_size):
            expected = sorted(group_of[rank]) if rank in group_of else None
            got = seen_by_rank[rank][k]
            if got != expected:
                kind_ok = False
                failures.append(f"{label}: rank {rank} expected {expected}, its all-reduce reached {got}")
        if kind_ok:
            verified += len(groups)
    lines.append("")
    total = sum(len(grid.get_rank_enum(dims, view=view)) for _, view, dims in config.kinds)
    if failures:
        lines.extend(f"FAILED {f}" for f in failures)
        lines.append(f"{verified} of {total} groups verified; {len(failures)} check(s) failed")
        return "\n".join(lines), False
    lines.append(
        f"all {total} groups verified ({len(config.kinds)} kinds): every all-reduce, on every rank of every "
        "group, reached exactly the group's members"
    )
    return "\n".join(lines), True


# ----------------------------------------------------------------------- main


def _size_text(config: DemoConfig, args: argparse.Namespace) -> str:
    """What asks for ``config.world_size`` processes, for an error message."""
    if args.world_size is not None:
        return f"--world-size {args.world_size}"
    sizes = "*".join(str(config.sizes[t]) for t in ("tp", "cp", "dp", "pp"))
    return f"the layout (tp*cp*dp*pp = {sizes})"


def _run_launched(world, config: DemoConfig) -> int:
    """This process as one rank of the launcher's ``world``: join, check, rank 0 prints the report."""
    import torch.distributed as dist

    from scripts.examples.launcher import LauncherError, join

    try:
        device = join(world, bind_device=config.bind_device)
    except LauncherError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        backend = "nccl on cuda:LOCAL_RANK" + (
            ", default group bound to the device (groups split from it)" if config.bind_device else ""
        )
    else:
        backend = "gloo on CPU"
    try:
        processes = "process" if world.world_size == 1 else "processes"
        report = _check_groups(world.rank, config, device, f"{processes} started by {world.launcher}, {backend}")
    finally:
        dist.destroy_process_group()
    if report is None:
        return 0  # rank 0 reports
    print(report[0], flush=True)
    return 0 if report[1] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, join the launcher's world or start the worker processes; the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = make_config(args)
    except DemoOptionError as exc:
        parser.error(str(exc))  # exits with code 2
    from scripts.examples.launcher import LauncherError, check_size, launched_world

    try:
        world = launched_world()
        if world is not None:
            check_size(world, config.world_size, _size_text(config, args))
    except LauncherError as exc:
        parser.error(str(exc))
    if world is not None:
        return _run_launched(world, config)
    if config.bind_device:
        parser.error("--bind-device needs a launcher (torchrun, srun) and CUDA: the demo's own processes use gloo")

    import functools

    import torch.multiprocessing as mp

    from parallel_state_ng.testing.forking import run_in_environ, worker_context

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the processes
    env = dict(os.environ)
    # forked from a server that has imported torch once (spawn where it cannot: forking.py); the
    # ranks never import megatron, so the server need not import the parts of torch it loads
    method = worker_context(env, for_megatron=False).get_start_method()
    with tempfile.TemporaryDirectory(prefix="psng-demo-") as tmp:
        try:
            mp.start_processes(
                functools.partial(run_in_environ, env, _rank_main),
                args=(config, os.path.join(tmp, "store")),
                nprocs=config.world_size,
                join=True,
                start_method=method,
            )
        except mp.ProcessRaisedException as exc:
            print(f"demo failed: a rank raised an error:\n{exc}", file=sys.stderr)
            return 1
        except mp.ProcessExitedException as exc:
            print(f"demo failed: rank {exc.error_index} exited with code {exc.exit_code}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "demo")
