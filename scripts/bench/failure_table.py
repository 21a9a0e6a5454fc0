"""The reliability table: a rank dies while groups are created; what do the survivors see?

W gloo processes build groups and the last rank exits inside its k-th ``new_group`` call; every
survivor reports whether it raised, after how long, whether the message names the dead rank and
how many groups it has left (a survivor silent for ``--cap`` seconds is a hang). A measurement,
not a test: it prints a markdown table. Cases, set-up and figures: docs/results/reliability.md (failure
table); every option below.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

WORLD = 4


def _build(impl: str, what: str) -> None:
    if impl == "mcore":
        from megatron.core import parallel_state as mps

        mps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        return
    if what == "init":
        import compat.parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    elif what == "collection":
        from parallel_state_ng import build_megatron_groups

        build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    elif what == "create_pg":
        from parallel_state_ng import HyperCommGrid

        grid = HyperCommGrid([2, 2], ["tp", "dp"], backend="gloo")
        try:
            for dims in ("tp", "dp", ["tp", "dp"]):
                grid.create_pg(dims)
        except BaseException:
            grid.destroy()
            raise
    else:
        from parallel_state_ng import ModuleSpec, build_topology

        build_topology(
            [
                ModuleSpec("vision", ranks=range(0, 2), tensor_model_parallel_size=2),
                ModuleSpec("language", ranks=range(2, 4), tensor_model_parallel_size=2, language=True),
            ],
            release="0.19",
        )


def _worker(rank: int, directory: str, impl: str, what: str, k: int, outbox: Any, env: dict) -> None:
    os.environ.update(env)
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(directory, "store"), WORLD)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, store=store, timeout=timedelta(minutes=30))
    if impl == "mcore":
        import megatron.core.parallel_state  # noqa: F401 - imported before the clock starts
    else:
        import compat.parallel_state  # noqa: F401
    dist.barrier()
    if rank == WORLD - 1:
        real, calls = dist.new_group, [0]

        def dying(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == k:
                os._exit(1)
            return real(*args, **kwargs)

        dist.new_group = dying
    before = len(dist.distributed_c10d._world.pg_map)
    start = time.monotonic()
    try:
        _build(impl, what)
        outcome: dict[str, Any] = {"raised": None}
    except Exception as exc:  # the outcome is what is measured
        outcome = {"raised": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    outcome["left"] = len(dist.distributed_c10d._world.pg_map) - before
    outbox.put((rank, outcome))
    outbox.close()
    outbox.join_thread()
    os._exit(0)


def run_case(impl: str, what: str, k: int, bound: float, cap: float) -> dict[int, Any]:
    """One world; ``{rank: outcome}`` for the survivors that reported within ``cap`` seconds."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    env = {"OMP_NUM_THREADS": "1", "PSNG_FAILURE_TIMEOUT": str(bound)}
    with tempfile.TemporaryDirectory() as directory:
        procs = [
            ctx.Process(target=_worker, args=(r, directory, impl, what, k, outbox, env), daemon=True)
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = None
        while len(results) < WORLD - 1:
            if deadline is None and not procs[-1].is_alive():
                deadline = time.monotonic() + cap  # the clock starts with the death
            if deadline is not None and time.monotonic() > deadline:
                break
            try:
                rank, value = outbox.get(timeout=0.5)
                results[rank] = value
            except queue.Empty:
                continue
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """Run the cases and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", type=float, default=30.0, help="PSNG_FAILURE_TIMEOUT for compat (seconds)")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds after the death before 'hang'")
    parser.add_argument(
        "--cases",
        default="compat:init:1,compat:init:6,compat:init:12,compat:collection:3,compat:create_pg:2,"
        "compat:topology:2,mcore:init:1,mcore:init:6,mcore:init:12",
        help="impl:what:k, comma-separated (k: the dying rank's new_group call that kills it); what: init "
        "(initialize_model_parallel, tp2 pp2, default arguments: gloo twins on), collection "
        "(build_megatron_groups), create_pg (a HyperCommGrid's create_pg calls), topology (build_topology, "
        "two modules); impl: compat, or mcore (megatron-core's own initialize_model_parallel, init only)",
    )
    args = parser.parse_args(argv)
    print(f"{WORLD} gloo processes, rank {WORLD - 1} exits in its k-th new_group call; "
          f"PSNG_FAILURE_TIMEOUT={args.bound:g} s; hang = nothing within {args.cap:g} s of the death")  # fmt: skip
    print()
    print("| impl | failure point | survivors raised | time to error (max) | dead rank named | groups left |")
    print("|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        impl, what, k = case.split(":")
        results = run_case(impl, what, int(k), args.bound, args.cap)
        raised = [r for r in results.values() if r["raised"]]
        hung = WORLD - 1 - len(results)
        named = all(f"[{WORLD - 1}]" in r["message"] for r in raised) if raised else False
        times = max((r["seconds"] for r in raised), default=float("nan"))
        left = sorted({r["left"] for r in results.values()})
        point = f"{what}, death in new_group #{k}"
        who = f"{len(raised)}/{WORLD - 1}" + (f" ({hung} hang)" if hung else "")
        if len(results) - len(raised):
            who += f" ({len(results) - len(raised)} returned)"
        shown = f"{times:.1f} s" if raised else f"none within {args.cap:g} s"
        print(
            f"| {impl} | {point} | {who} | {shown} | {'yes' if named else 'no'} | {left if results else 'n/a'} |",
            flush=True,
        )


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "failure_table")
