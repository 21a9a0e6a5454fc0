"""In-process restart over the survivors: abort, plan the new layout, re-initialize, communicate.

4 gloo ranks at tp 2 (dp 2); rank 3 dies. The survivors detect it in a collective (bounded),
agree on who died through the store, abort every group and the default group
(``abort_model_parallel(world=True)``), compute :func:`plan_rebuild` (tp kept, dp 2 -> 1), and
the ranks of the surviving replica initialize again in the same processes over a new default
group (a new prefix of the same store), then all-reduce over their new groups.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

from tests.support.failure_world import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD = 4
LOST = 3


def survivors(store, rank: int, world: int, epoch: int, wait_s: float) -> list[int]:
    """The ranks that answer within ``wait_s`` (each survivor leaves a mark; the dead cannot)."""
    store.set(f"alive/{epoch}/{rank}", "")
    deadline = time.monotonic() + wait_s
    alive = []
    for r in range(world):
        try:
            store.wait([f"alive/{epoch}/{r}"], timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
            alive.append(r)
        except Exception:  # noqa: BLE001 - no mark in time: dead
            pass
    return alive


def restart_after_loss(rank: int, directory: str) -> dict:
    import torch
    import torch.distributed as dist

    import compat.parallel_state as ps
    from parallel_state_ng.mcore.rebuild import plan_rebuild

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    layout = ps.get_state().layout
    store = dist.distributed_c10d._get_default_store()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3))  # detection bound of the test
    dist.barrier()
    if rank == LOST:
        os._exit(1)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        detected = False
    except RuntimeError:
        detected = True
    t_detect = time.monotonic() - t0
    # A survivor blocked until the 3 s bound marks late (a loaded machine adds seconds more): wait
    # well past the bound, or a live but slow survivor is taken for dead.
    alive = survivors(store, rank, WORLD, 0, 8.0)
    dead = sorted(set(range(WORLD)) - set(alive))
    t0 = time.monotonic()
    ps.abort_model_parallel(world=True)
    t_abort = time.monotonic() - t0
    plan = plan_rebuild(layout, dead, keep_spares=False)
    new_rank = plan.new_rank_of(rank)
    out = {"detected": detected, "detect_s": t_detect, "abort_s": t_abort, "dead": dead, "new_rank": new_rank}
    if new_rank is None:
        return out
    t0 = time.monotonic()
    dist.init_process_group(
        "gloo", rank=new_rank, world_size=plan.world_size, store=dist.PrefixStore("restart-1/", store)
    )
    ps.initialize_model_parallel(**plan.initialize_kwargs)
    out["rebuild_s"] = time.monotonic() - t0
    x = torch.tensor([float(new_rank + 1)])
    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    out.update(
        tp=ps.get_tensor_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_sum=x.item(),
        source=plan.source_of(new_rank),
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def test_restart_over_the_surviving_replica(tmp_path):
    results = run_world(WORLD, str(tmp_path), restart_after_loss, expect=WORLD - 1, timeout=90)
    assert sorted(results) == [0, 1, 2], results
    for rank, r in results.items():
        assert isinstance(r, dict), (rank, r)
        assert r["detected"] and r["dead"] == [LOST], r
        assert r["abort_s"] < 3.0, r
    # tp 2 x dp 2: tp groups [0, 1] and [2, 3]; rank 3 lost replica 1, replica 0 (ranks 0, 1) goes on
    kept = {rank: r for rank, r in results.items() if r["new_rank"] is not None}
    assert sorted(kept) == [0, 1] and results[2]["new_rank"] is None, results
    for rank, r in kept.items():
        assert r["new_rank"] == rank and r["source"] == rank  # its own state, nothing to move
        assert (r["tp"], r["dp"], r["tp_sum"]) == (2, 1, 3.0), r
