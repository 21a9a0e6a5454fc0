"""In-process restart on the new-code path: ``build_megatron_groups`` instead of compat's init.

The counterpart of ``test_rebuild_gloo.py`` with no module global: 4 gloo ranks get tp 2 × dp 2
from :func:`parallel_state_ng.build_megatron_groups`; rank 3 dies. The survivors detect it in
a collective (short bound), agree on who died through the store, abort every group and the
default group (:func:`parallel_state_ng.abort_groups` ``(world=True)``), plan over the
``MegatronGroups``' layout (:func:`plan_rebuild`: tp kept, dp 2 -> 1), and the ranks of the
surviving replica join a new default group (a new prefix of the same store) and build their
groups again with ``build_megatron_groups(**plan.build_kwargs)``, then all-reduce over them.
megatron is never imported (the collection object itself is not needed for the groups).
"""

from __future__ import annotations

import sys

import pytest

from tests.support.worlds.failure import RESTART_CASE, kept_after_shrink, lose_rank, run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD, LOST, DETECT_S, AGREE_S = RESTART_CASE


def restart_groups_after_loss(rank: int, directory: str) -> dict:
    import torch
    import torch.distributed as dist

    from parallel_state_ng import abort_groups, build_megatron_groups
    from parallel_state_ng.groups import creation
    from parallel_state_ng.layout.rebuild import plan_rebuild

    groups = build_megatron_groups(tensor_model_parallel_size=2)
    store = dist.distributed_c10d._get_default_store()
    out = lose_rank(rank, WORLD, LOST, DETECT_S, AGREE_S)
    aborted = abort_groups(world=True)
    out.update(
        abort_s=aborted.elapsed_s,
        abort_errors=aborted.errors,
        world_aborted=aborted.world_aborted,
        left_after_abort=len(dist.distributed_c10d._world.pg_map),
    )
    plan = plan_rebuild(groups.layout, out["dead"], keep_spares=False)
    new_rank = out["new_rank"] = plan.new_rank_of(rank)
    if new_rank is None:
        return out
    dist.init_process_group(
        "gloo", rank=new_rank, world_size=plan.world_size, store=dist.PrefixStore("restart-1/", store)
    )
    new = build_megatron_groups(**plan.build_kwargs)
    sums = {}
    for kind in ("tp", "dp"):
        x = torch.tensor([float(new_rank + 1)])
        dist.all_reduce(x, group=new.group(kind))
        sums[kind] = (new.ranks(kind), x.item())
    out.update(
        sums=sums,
        dp=new.layout.data_parallel_size,
        source=plan.source_of(new_rank),
        destroyed=new.destroy(),
        megatron_imported=any(name.split(".")[0] == "megatron" for name in sys.modules),
    )
    dist.destroy_process_group()
    out["left"] = len(dist.distributed_c10d._world.pg_map)
    out["live"] = len(creation.live_groups())
    return out


def test_restart_with_megatron_groups(tmp_path):
    results = run_world(WORLD, str(tmp_path), restart_groups_after_loss, expect=WORLD - 1, timeout=90)
    for r in results.values():
        assert r["world_aborted"] and not r["abort_errors"] and r["left_after_abort"] == 0, r
    for rank, r in kept_after_shrink(results, LOST).items():
        assert r["dp"] == 1 and r["sums"] == {"tp": ([0, 1], 3.0), "dp": ([rank], rank + 1.0)}, r
        assert r["destroyed"] > 0 and r["left"] == 0 and r["live"] == 0, r
        assert not r["megatron_imported"], r
