"""Train a tiny Megatron-Core GPT on CPU processes, with MCore's parallel_state or with compat.

Starts tp * pp * dp gloo processes and runs Megatron's own training loop on every rank
(``scripts/examples/gpt/training.py``); started by a launcher (torchrun, srun:
:mod:`scripts.examples.launcher`), every process is one rank of the launcher's world instead
(gloo on the CPU, or NCCL on ``cuda:LOCAL_RANK`` with ``--bind-device`` where CUDA is available).
``--loop training`` runs Megatron-LM's ``pretrain`` instead (``scripts/examples/gpt/pretrain_cli.py``).
Output and exit codes: :func:`main`. Layouts, figures and the ``pretrain`` loop: docs/results/training.md;
options: ``--help`` (``--loop training --help`` for that loop's).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from scripts.examples.gpt.config import (
    DISPATCHERS,
    GROUP_SOURCES,
    IMPLS,
    INSTALL_MODES,
    SHARE_SETTINGS,
    TrainConfig,
    TrainOptionError,
    validate,
)
from scripts.examples.gpt.processes import run_ranks

LOOPS = ("core", "training")  # our loop over megatron.core; Megatron-LM's megatron.training.pretrain


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Command line -> validated :class:`TrainConfig` (raises :class:`TrainOptionError`)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--loop",
        choices=LOOPS,
        default="core",
        help="core: this script's loop over megatron.core; training: Megatron-LM's megatron.training.pretrain "
        "(see --loop training --help)",
    )
    p.add_argument("--impl", choices=IMPLS, default="compat", help="parallel_state implementation")
    p.add_argument(
        "--install",
        choices=INSTALL_MODES,
        default="after",
        help="with --impl compat: install before or after importing megatron",
    )
    p.add_argument(
        "--groups",
        choices=GROUP_SOURCES,
        default="globals",
        help="globals: initialize_model_parallel; collection: parallel_state_ng.build_megatron_groups "
        "passed as pg_collection= (--impl mcore: no globals, megatron-core 0.19+; --impl compat: also "
        "served as the globals by compat.use_collection, 0.16+)",
    )
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp * pp), else 1)")
    p.add_argument("--world-size", type=int, default=None, help="processes (default: tp * pp * dp)")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (interleaved schedule)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (needs --experts)")
    p.add_argument("--experts", type=int, default=None, help="MoE experts per layer")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--dispatcher", choices=DISPATCHERS, default="alltoall", help="MoE token dispatcher")
    p.add_argument("--dist-opt", action="store_true", help="use the distributed optimizer")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="overlap_grad_reduce (and overlap_param_gather with --dist-opt)",
    )
    p.add_argument(
        "--all-gather-group",
        action="store_true",
        help="make the all-gather twins as megatron.training's --create-all-gather-group does (0.16+)",
    )
    p.add_argument(
        "--share-groups",
        dest="share",
        choices=SHARE_SETTINGS,
        default=None,
        help="with --impl compat: PSNG_SHARE_GROUPS for the run (default: the environment's)",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step and data-parallel rank")
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--init-from-names",
        action="store_true",
        help="set every weight from its global name (same model for every layout)",
    )
    p.add_argument("--megatron-path", default=None, help="directory put first on sys.path in every rank")
    p.add_argument(
        "--bind-device",
        action="store_true",
        help="under a launcher with CUDA: train on cuda:LOCAL_RANK over NCCL, the default group bound to the device",
    )
    args = p.parse_args(argv)
    dp = args.dp
    if args.world_size is not None:
        model_parallel = args.tp * args.pp
        if args.world_size < 1 or model_parallel < 1 or args.world_size % model_parallel:
            raise TrainOptionError(
                f"invalid training options:\n  --world-size {args.world_size} is not divisible by "
                f"tp * pp = {model_parallel}"
            )
        if dp is not None and dp * model_parallel != args.world_size:
            raise TrainOptionError(
                f"invalid training options:\n  tp * pp * dp = {dp * model_parallel} != --world-size {args.world_size}"
            )
        dp = args.world_size // model_parallel
    fields = {k: v for k, v in vars(args).items() if k not in ("world_size", "dp", "loop", "bind_device")}
    fields["init_from_names"] = args.init_from_names
    return validate(TrainConfig(dp=1 if dp is None else dp, verbose=True, **fields))


def _rank_main(rank: int, cfg: TrainConfig, store_path: str, results) -> None:
    """The core loop on one rank (see :func:`run_ranks`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    try:
        import torch.distributed as dist

        from scripts.examples.gpt.training import train_rank

        store = dist.FileStore(store_path, cfg.world_size)
        dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size, store=store)
        try:
            results.put((rank, True, train_rank(cfg)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def launch(cfg: TrainConfig, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Run ``cfg`` on ``cfg.world_size`` fresh processes; results ordered by rank.

    Raises ``RuntimeError`` with the failing ranks' tracebacks, or when the run exceeds
    ``timeout`` seconds (all processes are then killed).
    """
    return run_ranks(cfg.world_size, _rank_main, (cfg,), timeout)


def run_launched(world, cfg: TrainConfig, bind_device: bool) -> list[dict[str, Any]] | None:
    """Train ``cfg`` as this process's rank of the launcher's ``world``; every rank's result on
    rank 0 (None on the others).

    gloo on the CPU (the CPU stand-ins for CUDA); with ``bind_device`` and CUDA, Megatron as it
    is on ``cuda:LOCAL_RANK`` over NCCL, the default group bound to the device (globals only).
    """
    import torch.distributed as dist

    from parallel_state_ng.groups.objects import all_gather_objects
    from parallel_state_ng.testing.megatron_cpu import use_megatron_path
    from scripts.examples.gpt.training import parallel_state_impl, run_once
    from scripts.examples.launcher import join

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    device = join(world, bind_device=bind_device, use_cuda=None if bind_device else False)
    try:
        use_megatron_path(cfg.megatron_path)
        with parallel_state_impl(cfg.impl, cfg.install):
            result = run_once(cfg, device=str(device))
        # NCCL gathers no CPU objects: a gloo group for the results
        group = dist.new_group(backend="gloo") if device.type == "cuda" else None
        results = all_gather_objects(result, group=group)
    finally:
        dist.destroy_process_group()
    return results if world.rank == 0 else None


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Losses (checked equal on every last-stage rank), per-rank digests and their digest."""
    reported = [r["losses"] for r in results if r["losses"] is not None]
    if not reported or any(losses != reported[0] for losses in reported):
        raise RuntimeError(f"last-stage ranks report different losses: {reported}")
    digests = [r["digest"] for r in results]
    return {
        "losses": reported[0],
        "grad_norms": results[0]["grad_norms"],
        "rank_digests": digests,
        "digest": hashlib.sha256("".join(digests).encode()).hexdigest(),
        "leaked_groups": sum(r["leaked_groups"] for r in results),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Each step's loss (last pipeline stage, mean over microbatches and data-parallel
    ranks) is printed as it is computed; at the end a SHA-256 digest of all final parameters and
    ``losses: [...]``. Exit code 0 on success, 1 when a rank fails, 2 for bad options.
    """
    loop = argparse.ArgumentParser(add_help=False)
    loop.add_argument("--loop", choices=LOOPS, default="core")
    known, rest = loop.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.loop == "training":
        from scripts.examples.gpt import pretrain_cli

        return pretrain_cli.main(rest)
    argv = rest
    from scripts.examples.launcher import LauncherError, check_size, launched_world

    try:
        cfg = parse_args(argv)
        world = launched_world()
        if world is not None:
            check_size(world, cfg.world_size, f"tp * pp * dp = {cfg.tp} * {cfg.pp} * {cfg.dp}")
        elif "--bind-device" in argv:
            raise TrainOptionError("--bind-device needs a launcher (torchrun, srun) and CUDA")
    except (TrainOptionError, LauncherError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    impl = cfg.impl if cfg.impl == "mcore" else f"compat (install {cfg.install} importing megatron)"
    if cfg.groups == "collection":
        impl = "none: a ProcessGroupCollection from parallel_state_ng.build_megatron_groups"
        if cfg.impl == "compat":
            impl = "compat.use_collection over a ProcessGroupCollection from parallel_state_ng.build_megatron_groups"
    where = f"{cfg.world_size} CPU processes (gloo)"
    if world is not None:
        where = f"{cfg.world_size} processes started by {world.launcher}"
    if world is None or world.rank == 0:
        print(
            f"GPT {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, vocab {cfg.vocab}, "
            f"seq {cfg.seq}; {where}: {cfg.label()}; parallel_state: {impl}",
            flush=True,
        )
    start = time.monotonic()
    try:
        if world is None:
            results = launch(cfg)
        else:
            launched = run_launched(world, cfg, "--bind-device" in argv)
            if launched is None:
                return 0  # rank 0 reports
            results = launched
        summary = summarize(results)
    except (RuntimeError, LauncherError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"parameter digest: {summary['digest']}")
    print(f"losses: {summary['losses']}")
    print(f"wall time: {time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "train_gpt")
