"""Megatron 0.19's inference collection on one simulated rank: ours vs Megatron's own function.

One rank of a fake-backend world (65,536 ranks by default) builds an inference model's
``ProcessGroupCollection`` with :func:`parallel_state_ng.builders.inference.build_inference_collection`
and with ``megatron.core.inference.shards.build_inference_pg_collection`` (megatron-core 0.19,
from ``--megatron-path``, e.g. the unzipped wheel), then a two-shard layout with both
``..._for_shards`` functions. Prints median seconds, ``new_group`` calls on the rank and the
speed-up. Figures and command: docs/results/performance.md (Inference shards).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from parallel_state_ng.testing.calls import NewGroupCalls
from parallel_state_ng.testing.worlds import init_simulated_rank

DEFAULT_SIZES = {"tp_size": 8, "pp_size": 4, "cp_size": 1, "ep_size": 8, "expt_tp_size": 1}
DEFAULT_SHARDS = "tp=8,pp=4,ep=8,expt_tp=1,dp={half_dp}+tp=4,dp={rest}"


def _timed(rank: int, world: int, build: Callable[[], Any], repeats: int) -> tuple[float, int, Any]:
    """Median seconds of ``build()`` on a fresh world each time, its new_group calls, its last result."""
    times, calls, result = [], 0, None
    for _ in range(repeats):
        init_simulated_rank(rank, world, replace=True)
        with NewGroupCalls() as count:
            start = time.perf_counter()
            result = build()
            times.append(time.perf_counter() - start)
        calls = count.calls
    return statistics.median(times), calls, result


def _ranks(collection: Any) -> dict[str, Any]:
    return {k: None if v is None else dist.get_process_group_ranks(v) for k, v in vars(collection).items()}


def _shards_spec(world: int) -> str:
    first = 8 * 4  # tp * pp of the first shard
    return DEFAULT_SHARDS.format(half_dp=world // 2 // first, rest=world // 2 // 4)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, time both sides on one simulated rank, print the table; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-path", default=None, help="directory holding megatron-core 0.19 (an unzipped wheel)")
    p.add_argument("--world", type=int, default=65536, help="simulated world size (a multiple of 64)")
    p.add_argument("--rank", type=int, default=None, help="the simulated rank (default: world // 2 + 3)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of ours (Megatron's: --megatron-repeats)")
    p.add_argument("--megatron-repeats", type=int, default=1, help="timed runs of Megatron's functions")
    args = p.parse_args(argv)
    if args.world % 64 or args.world < 64:
        p.error(f"--world must be a positive multiple of 64, got {args.world}")
    from parallel_state_ng.testing.megatron_cpu import use_megatron_path

    use_megatron_path(args.megatron_path)
    try:
        import megatron.core.inference.shards as megatron_shards  # imported before any clock
    except ImportError as err:
        print(f"error: megatron-core 0.19 is not importable ({err}); give it with --megatron-path DIR", file=sys.stderr)
        return 2
    from parallel_state_ng.builders import inference

    world, rank = args.world, args.world // 2 + 3 if args.rank is None else args.rank
    spec = _shards_spec(world)
    rows = [
        (
            f"one window, {' '.join(f'{k[:-5]} {v}' for k, v in DEFAULT_SIZES.items())}",
            lambda: inference.build_inference_collection(world, **DEFAULT_SIZES, check_agreement=False),
            lambda: megatron_shards.build_inference_pg_collection(world, **DEFAULT_SIZES),
        ),
        (
            f"shards {spec}",
            lambda: inference.build_inference_collections_for_shards(world, spec, check_agreement=False),
            lambda: megatron_shards.build_inference_pg_collections_for_shards(world, spec),
        ),
    ]
    print(f"one simulated rank ({rank} of {world}, fake backend); ours: median of {args.repeats}, "
          f"Megatron's: median of {args.megatron_repeats}; agreement check off")  # fmt: skip
    print(f"{'build':<58} | {'ours s':>8} {'calls':>5} | {'megatron s':>10} {'calls':>7} | {'speed-up':>8}")
    for label, ours_build, megatron_build in rows:
        ours_s, ours_calls, ours_result = _timed(rank, world, ours_build, args.repeats)
        ours_view = _view(ours_result)
        megatron_s, megatron_calls, megatron_result = _timed(rank, world, megatron_build, args.megatron_repeats)
        if _view(megatron_result) != ours_view:
            print(f"error: {label}: the groups differ from Megatron's", file=sys.stderr)
            return 1
        print(
            f"{label:<58} | {ours_s:>8.4f} {ours_calls:>5} | {megatron_s:>10.2f} {megatron_calls:>7} | "
            f"{megatron_s / ours_s:>7.0f}x",
            flush=True,
        )
    dist.destroy_process_group()
    return 0


def _view(result: Any) -> Any:
    """A collection's (or a shard list's collections') ranks, to check both sides built the same groups."""
    if isinstance(result, list):
        return [None if s.pg_collection is None else _ranks(s.pg_collection) for s in result]
    return _ranks(result)


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "inference")
