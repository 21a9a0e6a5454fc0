"""The split path at scale: creation calls and Python time per rank, against MCore and the floor.

One simulated rank (fake backend) of worlds of 4,096 and 65,536 ranks, tp 8 pp 4 cp 2 ep 8, a
default group that splits: ours (compat's init on the split path, ``PSNG_CREATION_PATH=split``),
the floor (bare ``split_group`` calls for the same groups, lists computed before the clock) and
MCore (a ``new_group`` call for every group of the world on every rank: each one a world-wide
split on NCCL). ``split_group`` is a recorder that makes the member's group on the fake backend,
the same for ours and the floor. Method and figures: docs/results/gpus.md (performance).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

#: torch's own new_group, as the recorder calls it (the counter of engine calls wraps the module's).
TORCH_NEW_GROUP = dist.new_group
CONFIG = {
    "tensor_model_parallel_size": 8,
    "pipeline_model_parallel_size": 4,
    "context_parallel_size": 2,
    "expert_model_parallel_size": 8,
}


class Recorder:
    """Stands in for ``torch.distributed.split_group``: counts the calls, makes the member's group."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, parent_pg: Any = None, split_ranks: Any = None, **kwargs: Any) -> Any:
        """One split: the member's group on the fake backend, ``None`` for a rank without a colour."""
        self.calls += 1
        mine = split_ranks[0]
        if dist.get_rank() not in mine:
            return None
        return TORCH_NEW_GROUP(sorted(mine), use_local_synchronization=True)


def _world(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def ours(rank: int, world: int) -> tuple[float, int, int]:
    """Compat's init on the split path: (seconds, split calls, new_group calls)."""
    import compat.parallel_state as ps

    _world(rank, world)
    recorder, counted = Recorder(), _count_new_group()
    dist.split_group = recorder
    start = time.perf_counter()
    ps.initialize_model_parallel(create_gloo_process_groups=False, **CONFIG)
    took = time.perf_counter() - start
    calls = counted()
    ps.destroy_model_parallel()
    return took, recorder.calls, calls


def floor(rank: int, world: int) -> tuple[float, int]:
    """Bare ``split_group`` calls for exactly the rank's splits: (seconds, calls)."""
    from parallel_state_ng.layout.megatron_layout import MegatronLayout
    from parallel_state_ng.layout.plan import PlanOptions, SplitOut, group_plan

    _world(rank, world)
    layout = MegatronLayout(world_size=world, **CONFIG)
    steps = group_plan(layout, rank, PlanOptions(create_gloo_process_groups=False), every_split=True)
    other = [[(rank + 1) % world]]
    splits = [(other if isinstance(s, SplitOut) else [s.ranks], s.desc) for s in steps if hasattr(s, "desc")]
    recorder = Recorder()
    start = time.perf_counter()
    made = [recorder(None, lists, group_desc=desc) for lists, desc in splits]
    took = time.perf_counter() - start
    for group in made:
        if group is not None:
            dist.destroy_process_group(group)
    return took, recorder.calls


def mcore(rank: int, world: int) -> tuple[float, int]:
    """MCore's init: (seconds, new_group calls), each a world-wide split under a bound device."""
    from megatron.core import parallel_state as mps

    _world(rank, world)
    counted = _count_new_group()
    start = time.perf_counter()
    mps.initialize_model_parallel(create_gloo_process_groups=False, **CONFIG)
    took = time.perf_counter() - start
    calls = counted()
    mps.destroy_model_parallel()
    return took, calls


def _count_new_group():
    original, calls = dist.new_group, [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.new_group = counting

    def done() -> int:
        dist.new_group = original
        return calls[0]

    return done


def main(argv: Sequence[str] | None = None) -> None:
    """Print one row per world: calls per rank and Python time, ours vs the floor and MCore."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4096,65536", help="comma-separated world sizes")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of ours and the floor")
    parser.add_argument("--mcore-rounds", type=int, default=1, help="rounds of MCore's init (0: skip)")
    args = parser.parse_args(argv)
    os.environ["PSNG_CREATION_PATH"] = "split"
    original_split = dist.split_group
    print(
        f"{'world':>7} {'rank':>6} | {'splits':>6} {'new_group':>9} | {'mcore calls':>11} {'fewer':>7} | "
        f"{'ours s':>8} {'floor s':>8} {'ours/floor':>10} | {'mcore s':>8}"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        rank = world // 2 + 3
        times_ours, times_floor = [], []
        for _ in range(args.rounds):
            took, splits, new_groups = ours(rank, world)
            times_ours.append(took)
            took_floor, floor_calls = floor(rank, world)
            times_floor.append(took_floor)
        dist.split_group = original_split
        assert splits == floor_calls, (splits, floor_calls)
        mcore_times, mcore_calls = [], 0
        for _ in range(args.mcore_rounds):
            took, mcore_calls = mcore(rank, world)
            mcore_times.append(took)
        ours_s, floor_s = statistics.median(times_ours), statistics.median(times_floor)
        ours_calls = splits + new_groups
        fewer = f"{mcore_calls / ours_calls:.0f}x" if mcore_calls else "-"
        mcore_s = f"{statistics.median(mcore_times):.3f}" if mcore_times else "-"
        print(
            f"{world:>7} {rank:>6} | {splits:>6} {new_groups:>9} | {mcore_calls or '-':>11} {fewer:>7} | "
            f"{ours_s:>8.4f} {floor_s:>8.4f} {ours_s / floor_s:>9.2f}x | {mcore_s:>8}"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "split")
