"""scripts/gpu/world.py on gloo: the launcher every N-rank GPU check runs on (docs/results/gpus.md).

On NCCL each rank gets its own ``NCCL_HOSTID`` on one GPU; here the same launcher runs gloo
ranks (the bound mode with a bound CPU device and the gloo split stand-in), so CI covers the
spawning, the result collection by rank and the failure reports.
"""

from __future__ import annotations

import os

import pytest

from scripts.gpu.world import RankContext, WorldError, hello, run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _fails_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise KeyError("on purpose")
    return ctx.rank


def _rank_1_dies(ctx: RankContext) -> int:
    if ctx.rank == 1:
        os._exit(3)
    return ctx.rank


def test_every_rank_runs_the_body_in_a_world_that_splits():
    results = run_world(2, hello, backend="gloo", mode="bound", timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 2.0 and r["splits"] for r in results), results


@pytest.mark.rotating(6, 10)  # end-to-end part 7 of 10 (docs/testing.md, "Rotating parts")
def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(WorldError, match=r"1 rank\(s\) of 2 failed: \[1\]") as info:
        run_world(2, _fails_on_rank_1, backend="gloo", mode="lazy", timeout=120)
    assert info.value.ranks == [1]
    assert "--- rank 1:\nKeyError: 'on purpose'" in str(info.value)


@pytest.mark.rotating(6, 10)  # end-to-end part 7 of 10 (docs/testing.md, "Rotating parts")
def test_a_rank_that_dies_is_named_unless_it_may():
    with pytest.raises(WorldError, match=r"(?s)\[1\].*rank 1:\nprocess exited with code 3 and no result"):
        run_world(2, _rank_1_dies, backend="gloo", timeout=120)
    assert run_world(2, _rank_1_dies, backend="gloo", timeout=120, may_die=(1,)) == [0, None]


def _waits_forever(ctx: RankContext) -> int:
    import time

    while True:
        time.sleep(1)


@pytest.mark.rotating(3, 10)  # end-to-end part 4 of 10 (docs/testing.md, "Rotating parts")
def test_a_rank_still_running_at_the_timeout_shows_where_it_is():
    # faulthandler's dump on SIGUSR1 (registered first thing in each rank): where a rank stopped,
    # which on NCCL tells a slow world from one blocked in a collective
    with pytest.raises(WorldError, match=r"rank\(s\) \[0\]: no result in 6 s") as info:
        run_world(1, _waits_forever, backend="gloo", timeout=6)
    # the stack itself, or why there is none (a rank signalled before it registered the dump)
    section = str(info.value).split("--- rank 0: stack at the timeout (most recent call first)\n")[1]
    assert section.startswith(("Thread 0x", "Current thread 0x", "(no stack: ")), section


def test_bad_arguments_start_nothing():
    with pytest.raises(ValueError, match=r"size must be an int >= 1, got 0"):
        run_world(0, hello, backend="gloo")
    with pytest.raises(ValueError, match=r"backend must be one of \('nccl', 'gloo'\).*got 'mpi'"):
        run_world(2, hello, backend="mpi")
