"""``python -m scripts.examples train_gpt --loop training``: Megatron-LM's own ``pretrain`` on CPU processes.

The script's own options are ``--loop``, ``--impl``, ``--install``, ``--megatron-path``, ``--nproc``,
``--sleep-wake`` and ``--quiet`` (``--loop training --help``); everything else goes, unchanged, to Megatron's
argument parser in every rank (see :mod:`scripts.examples.gpt.pretrain` for the defaults put
before it). Importing this module imports neither torch nor megatron. Example command and
figures: docs/results/training.md (run Megatron-LM's training loop on compat).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scripts.examples.gpt.config import IMPLS, INSTALL_MODES
from scripts.examples.gpt.processes import run_ranks

_SIZE_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")


@dataclass(frozen=True)
class PretrainRun:
    """One ``--loop training`` run: processes, parallel_state and Megatron's own arguments."""

    nproc: int
    megatron_args: tuple[str, ...]
    impl: str = "compat"
    install: str = "after"
    megatron_path: str | None = None
    quiet: bool = False
    sleep_wake: bool = False


def parse_args(argv: Sequence[str], launched_size: int | None = None) -> PretrainRun:
    """The script's options; the rest of ``argv`` is kept for Megatron's parser.

    ``launched_size``: the size of the launcher's world this process is in (the default
    ``--nproc``; a different one is refused).
    """
    p = argparse.ArgumentParser(
        prog="python -m scripts.examples train_gpt --loop training",
        description="Run megatron.training.pretrain on CPU processes; unknown options go to Megatron's parser.",
    )
    p.add_argument("--impl", choices=IMPLS, default="compat", help="parallel_state implementation")
    p.add_argument("--install", choices=INSTALL_MODES, default="after", help="with --impl compat: before/after import")
    p.add_argument("--megatron-path", default=None, help="directory put first on sys.path in every rank")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: tp * pp * cp)")
    p.add_argument("--quiet", action="store_true", help="hide the ranks' own output (Megatron's log)")
    wake = "with --impl compat: every communicator asleep and awake again after each iteration"
    p.add_argument("--sleep-wake", action="store_true", help=wake)
    ns, rest = p.parse_known_args(argv)
    sizes = argparse.ArgumentParser(add_help=False)
    for flag in _SIZE_FLAGS:
        sizes.add_argument(flag, type=int, default=1)
    known, _ = sizes.parse_known_args(rest)
    model_parallel = known.tensor_model_parallel_size * known.pipeline_model_parallel_size
    model_parallel *= known.context_parallel_size
    nproc = ns.nproc if ns.nproc is not None else (launched_size or model_parallel)
    if ns.sleep_wake and ns.impl != "compat":
        p.error("--sleep-wake needs --impl compat (MCore has no sleep)")
    if launched_size is not None and nproc != launched_size:
        p.error(f"--nproc {nproc} is not the launcher's world of {launched_size} processes")
    if nproc < 1 or model_parallel < 1 or nproc % model_parallel:
        p.error(f"--nproc {nproc} is not a multiple of tp * pp * cp = {model_parallel}")
    from parallel_state_ng.testing.megatron_cpu import MEGATRON_PATH_ENV  # imports torch: not at module import

    path = ns.megatron_path or os.environ.get(MEGATRON_PATH_ENV)
    return PretrainRun(nproc, tuple(rest), ns.impl, ns.install, path and os.path.abspath(path), ns.quiet, ns.sleep_wake)


def rank_main(rank: int, run: PretrainRun, store_path: str, results) -> None:
    """One rank (spawned by :func:`~scripts.examples.gpt.processes.run_ranks`): ``pretrain.pretrain_rank``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import warnings

        warnings.filterwarnings("ignore")
        if run.quiet:
            devnull = open(os.devnull, "w")  # noqa: SIM115  (for the life of the process)
            sys.stdout = sys.stderr = devnull
            os.dup2(devnull.fileno(), 1)
            os.dup2(devnull.fileno(), 2)
        from parallel_state_ng.testing.megatron_cpu import use_megatron_path

        use_megatron_path(run.megatron_path)
        from scripts.examples.gpt.pretrain import pretrain_rank

        args = (rank, run.nproc, store_path, list(run.megatron_args), run.impl, run.install, run.sleep_wake)
        record = pretrain_rank(*args)
        results.put((rank, True, record))
    except BaseException as exc:  # the parent reports it
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-iteration losses (equal on every last-stage rank) and gradient norms (equal on every
    rank), per-rank digests and their digest, timings (slowest rank).
    """
    reported = [[it["losses"] for it in r["iterations"]] for r in records if r["last_stage"]]
    if not reported or any(x != reported[0] for x in reported):
        raise RuntimeError(f"last-stage ranks report different losses: {reported}")
    norms = [[it["grad_norm"] for it in r["iterations"]] for r in records]
    if any(x != norms[0] for x in norms):
        raise RuntimeError(f"ranks report different gradient norms: {norms}")
    digests = [r["digest"] for r in records]
    return {
        "iterations": [it["iteration"] for it in records[0]["iterations"]],
        "losses": reported[0],
        "grad_norms": norms[0],
        "rank_digests": digests,
        "digest": hashlib.sha256("".join(digests).encode()).hexdigest(),
        "facts": records[0]["facts"],
        "seconds": {k: max(r["seconds"][k] for r in records) for k in records[0]["seconds"]},
        "iteration_seconds": [max(s) for s in zip(*(r["iteration_seconds"] for r in records), strict=True)],
        "sleep_cycles": [r["sleep"]["cycles"] for r in records],
        "sleep_mechanisms": records[0]["sleep"]["mechanisms"],
    }


def run_launched(run: PretrainRun, rank: int) -> list[dict[str, Any]] | None:
    """``pretrain`` as this process's rank of the launcher's world (gloo, env://); every rank's
    record on rank 0, None on the others. ``--quiet`` hides Megatron's output while it runs.
    """
    import warnings

    from parallel_state_ng.testing.megatron_cpu import use_megatron_path
    from scripts.examples.gpt.pretrain import pretrain_rank

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    use_megatron_path(run.megatron_path)
    saved = [os.dup(1), os.dup(2)] if run.quiet else []
    try:
        if run.quiet:
            sys.stdout.flush()
            sys.stderr.flush()
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 1)
                os.dup2(devnull.fileno(), 2)
        records = pretrain_rank(rank, run.nproc, None, list(run.megatron_args), run.impl, run.install, run.sleep_wake)
    finally:
        for fd, copy in enumerate(saved, start=1):
            sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            os.dup2(copy, fd)
            os.close(copy)
    return records if rank == 0 else None


def main(argv: Sequence[str]) -> int:
    """``--loop training`` entry point (exit codes as for the core loop); under a launcher
    (:mod:`scripts.examples.launcher`) this process is one rank of its world and rank 0 reports.
    """
    from scripts.examples.launcher import LauncherError, launched_world

    try:
        world = launched_world()
        run = parse_args(argv, None if world is None else world.world_size)
    except LauncherError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:
        return int(exc.code or 0)
    if world is not None and world.rank != 0:
        run_launched(run, world.rank)
        return 0
    impl = run.impl if run.impl == "mcore" else f"compat (install {run.install} importing megatron)"
    where = f" from {run.megatron_path}" if run.megatron_path else ""
    procs = f"{run.nproc} CPU processes" + ("" if world is None else f" started by {world.launcher}")
    print(f"megatron.training.pretrain{where} on {procs} (gloo); parallel_state: {impl}")
    print(f"Megatron arguments: {' '.join(run.megatron_args) or '(defaults)'}", flush=True)
    start = time.monotonic()
    try:
        if world is None:
            records = run_ranks(run.nproc, rank_main, (run,), timeout=900.0)
        else:
            records = run_launched(run, world.rank) or []
        summary = summarize(records)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with contextlib.suppress(BrokenPipeError):
        for it, losses, norm in zip(summary["iterations"], summary["losses"], summary["grad_norms"], strict=True):
            shown = "  ".join(f"{k} {v:.6f}" for k, v in losses.items())
            print(f"iteration {it}: {shown}  grad norm {norm:.6f}")
        print(f"megatron-core {summary['facts']['version']}; parallel_state used: {summary['facts']['parallel_state']}")
        print(f"parameter digest: {summary['digest']}")
        if run.sleep_wake:
            cycles = summary["sleep_cycles"]
            print(
                f"sleep/wake cycles (after Megatron's post_training_step_callbacks, per rank): {cycles}; "
                f"rank 0's groups by mechanism: {summary['sleep_mechanisms']}"
            )
        print(f"losses: {[next(iter(x.values())) for x in summary['losses']]}")
        sec = summary["seconds"]
        per_iter = ", ".join(f"{s:.3f}" for s in summary["iteration_seconds"])
        print(
            f"seconds (slowest rank): import {sec['import']:.1f}, pretrain {sec['pretrain']:.1f}; "
            f"per iteration (the first includes initialize and setup) {per_iter}"
        )
        print(f"wall time: {time.monotonic() - start:.1f} s", flush=True)
    return 0
