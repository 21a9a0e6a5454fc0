"""One module's full ProcessGroupCollection on one simulated rank: ours vs Megatron's grids vs the floor.

tp 8, pp 4, cp 2, ep 8 on the middle rank of a fake-backend world (one process per world size):
``ours`` (:func:`parallel_state_ng.build_megatron_groups` plus every collection field), ``mcore
grids`` (Megatron's ``HyperCommGrid`` assembled as its MiMo example does) and ``floor`` (bare
``new_group`` for exactly this rank's groups). Prints median seconds, ``new_group`` calls and
the ratios. Sides, goals and figures: docs/results/performance.md (one module's ProcessGroupCollection).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from parallel_state_ng import build_megatron_groups
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, group_plan
from parallel_state_ng.testing.calls import NewGroupCalls
from parallel_state_ng.testing.worlds import init_simulated_rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {
    "tensor_model_parallel_size": 8,
    "pipeline_model_parallel_size": 4,
    "context_parallel_size": 2,
    "expert_model_parallel_size": 8,
}
#: Dims of each field in the grids of Megatron's multi-module example.
DENSE_FIELDS = {
    "tp": ["tp"],
    "cp": ["cp"],
    "dp": ["dp"],
    "pp": ["pp"],
    "dp_cp": ["cp", "dp"],
    "mp": ["tp", "pp"],
    "tp_cp": ["tp", "cp"],
    "tp_dp_cp": ["tp", "cp", "dp"],
}
EXPERT_FIELDS = {
    "ep": ["ep"],
    "expt_tp": ["tp"],
    "tp_ep": ["tp", "ep"],
    "tp_ep_pp": ["tp", "ep", "pp"],
    "expt_dp": ["dp"],
}


def _ours() -> tuple[float, int]:
    with NewGroupCalls() as count:
        start = time.perf_counter()
        groups = build_megatron_groups(**SIZES, check_agreement_across_ranks=False)
        values = groups.field_values()
        elapsed = time.perf_counter() - start
    assert values["tp"] is not None and values["expt_dp"] is not None
    groups.destroy()  # not timed, as the floor's destroy is not
    return elapsed, count.calls


def _floor(lists: list[list[int]]) -> tuple[float, int]:
    with NewGroupCalls() as count:
        start = time.perf_counter()
        made = [dist.new_group(ranks, use_local_synchronization=True) for ranks in lists]
        elapsed = time.perf_counter() - start
    for group in made:
        dist.destroy_process_group(group)
    return elapsed, count.calls


def _megatron_grids(world: int) -> int:
    from megatron.core.hyper_comm_grid import HyperCommGrid  # imported before the clock (see _row)

    tp, pp, cp, ep = (SIZES[k] for k in SIZES)
    dp = world // (tp * pp * cp)
    with NewGroupCalls() as count:
        dense = HyperCommGrid([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"])
        expert = HyperCommGrid([tp, ep, world // (tp * ep * pp), pp], ["tp", "ep", "dp", "pp"])
        fields = {name: dense.create_pg(dims) for name, dims in DENSE_FIELDS.items()}
        fields.update({name: expert.create_pg(dims) for name, dims in EXPERT_FIELDS.items()})
        rank = dist.get_rank()
        for pipeline in dense.get_rank_enum(["pp"]):
            embd = dist.new_group([pipeline[0], pipeline[-1]])
            pos = dist.new_group([pipeline[0]])
            if rank in pipeline:
                fields["embd"], fields["pos_embd"] = embd, pos
    return count.calls


def _median(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _row(world: int, repeats: int, mcore_max: int) -> str:
    """One world's table row, measured in this process (a fresh one per world: see ``main``)."""
    rank = world // 2 + 3
    init_simulated_rank(rank, world, replace=True)
    layout = MegatronLayout(world_size=world, **SIZES)
    lists = [s.ranks for s in group_plan(layout, rank) if isinstance(s, CreateGroup) and s.backend != "gloo"]
    ours_runs, floor_runs = [], []
    for _ in range(repeats):  # alternating, so that load changes hit both alike
        ours_runs.append(_ours())
        floor_runs.append(_floor(lists))
    ours_s, ours_calls = statistics.median(t for t, _ in ours_runs), ours_runs[0][1]
    floor_s, floor_calls = statistics.median(t for t, _ in floor_runs), floor_runs[0][1]
    assert ours_calls == len(lists) == floor_calls, (ours_calls, len(lists), floor_calls)
    if world <= mcore_max:
        import megatron.core.hyper_comm_grid  # noqa: F401  (the import is not part of the assembly)

        mcore_runs = []
        for _ in range(min(repeats, 3)):
            # a clean world each time: Megatron's grids leave every group alive
            init_simulated_rank(rank, world, replace=True)
            start = time.perf_counter()
            mcore_calls = _megatron_grids(world)
            mcore_runs.append(time.perf_counter() - start)
        mcore_s = statistics.median(mcore_runs)
        mcore = f"{mcore_s:>13.3f} {mcore_calls:>7} | {mcore_s / ours_s:>9.0f}x {mcore_s / floor_s:>10.0f}x"
    else:
        mcore = f"{'skipped':>13} {'':>7} | {'':>10} {'':>11}"
    dist.destroy_process_group()
    return (
        f"{world:>9} {rank:>8} | {ours_s:>8.4f} {ours_calls:>5} | {floor_s:>8.4f} {floor_calls:>5} | "
        f"{mcore} {ours_s / floor_s:>9.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, measure each world in a fresh process and print the table; returns the exit status.

    Goals (issue 17): ours >= 100x faster than Megatron's grids at 65,536 ranks, <= 1.5x the
    floor, and as many ``new_group`` calls as the rank has groups.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4096, 65536, 1048576], help="world sizes")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed runs of ours and the floor, alternating (Megatron's grids: 3)"
    )
    p.add_argument("--mcore-max", type=int, default=65536, help="largest world to time Megatron's grids at")
    p.add_argument("--one-world", type=int, default=None, help=argparse.SUPPRESS)  # the per-world child
    args = p.parse_args(argv)
    if args.one_world is not None:
        print(_row(args.one_world, args.repeats, args.mcore_max), flush=True)
        return 0
    print(
        f"one simulated rank (fake backend), tp 8 pp 4 cp 2 ep 8, median of {args.repeats}, a fresh process per world"
    )
    header = f"{'world':>9} {'rank':>8} | {'ours s':>8} {'calls':>5} | {'floor s':>8} {'calls':>5} | "
    columns = f"{'mcore grids s':>13} {'calls':>7} | {'mcore/ours':>10} {'mcore/floor':>11} {'ours/floor':>10}"
    print(header + columns, flush=True)
    for world in args.worlds:
        # A fresh process per world: groups and objects of a larger earlier world slow the next one's
        # new_group calls (garbage collection over them), for ours and the floor alike.
        options = ["--one-world", str(world), "--repeats", str(args.repeats), "--mcore-max", str(args.mcore_max)]
        done = subprocess.run(
            [sys.executable, "-m", "scripts.bench", "collection", *options], capture_output=True, text=True, cwd=ROOT
        )
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        print(done.stdout.rstrip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "collection")
