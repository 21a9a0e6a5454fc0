"""In-process restart over the survivors: abort, plan the new layout, re-initialize, communicate.

4 gloo ranks at tp 2 (dp 2); rank 3 dies. The survivors detect it in a collective (bounded),
agree on who died through the store, abort every group and the default group
(``abort_model_parallel(world=True)``), compute :func:`plan_rebuild` (tp kept, dp 2 -> 1), and
the ranks of the surviving replica initialize again in the same processes over a new default
group (a new prefix of the same store), then all-reduce over their new groups.
"""

from __future__ import annotations

import time

import pytest

from tests.support.worlds.failure import RESTART_CASE, kept_after_shrink, lose_rank, run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD, LOST, DETECT_S, AGREE_S = RESTART_CASE


def restart_after_loss(rank: int, directory: str) -> dict:
    import torch
    import torch.distributed as dist

    import compat.parallel_state as ps
    from parallel_state_ng.layout.rebuild import plan_rebuild

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    layout = ps.get_state().layout
    store = dist.distributed_c10d._get_default_store()
    out = lose_rank(rank, WORLD, LOST, DETECT_S, AGREE_S)
    t0 = time.monotonic()
    ps.abort_model_parallel(world=True)
    t_abort = time.monotonic() - t0
    plan = plan_rebuild(layout, out["dead"], keep_spares=False)
    new_rank = plan.new_rank_of(rank)
    out.update(abort_s=t_abort, new_rank=new_rank)
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
    for r in kept_after_shrink(results, LOST).values():
        assert (r["tp"], r["dp"], r["tp_sum"]) == (2, 1, 3.0), r
