"""``build_megatron_groups``: one module's Megatron groups and its ProcessGroupCollection, no globals.

Fake backend (simulated ranks, one process): the installed megatron-core's collection class and
fields, membership of a rank range, no global touched, only the rank's own ``new_group`` calls
(also at 65,536 ranks), atomic failure, a bad-argument table, destroy without leaks.
Real gloo world of 4: every field's group reduces over its members, and ranks that pass
different arguments all raise instead of hanging. The field-by-field comparison with each
release's ``use_mpu_process_groups()`` is in ``tests/releases/test_collection_releases.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.builders.collection import (
    FIELD_GLOBALS,
    MegatronGroups,
    NoCollectionError,
    build_megatron_groups,
)
from parallel_state_ng.groups.agreement import ParallelConfigMismatchError
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, group_plan
from parallel_state_ng.releases import current_release
from parallel_state_ng.releases import process_groups_config as facts
from tests.support.served import has_collection, skip_unless


def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


TP2_PP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}


def test_collection_of_the_installed_release(fake_world):
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    pytest.importorskip("megatron.core.process_groups_config")
    from megatron.core.process_groups_config import ProcessGroupCollection

    fake_world(5, 8)
    with build_megatron_groups(**TP2_PP2) as groups:
        pgc = groups.collection()
        assert isinstance(pgc, ProcessGroupCollection)
        names = [f.name for f in dataclasses.fields(pgc)]
        assert names == list(facts.collection_fields(current_release()))
        assert dist.get_process_group_ranks(pgc.tp) == [4, 5]
        assert dist.get_process_group_ranks(pgc.pp) == [1, 5]
        assert dist.get_process_group_ranks(pgc.dp) == [5, 7]
        assert dist.get_process_group_ranks(pgc.mp) == [0, 1, 4, 5]
        assert dist.get_process_group_ranks(pgc.embd) == [1, 5]  # first and last stage
        assert pgc.pos_embd is None  # the last stage has no position embedding
        assert pgc.hcp is None and pgc.inter_dist_opt is None
        assert pgc.tp is groups.group("tp") and groups.ranks("tp") == [4, 5]


def test_no_module_global_is_touched(fake_world):
    import compat.parallel_state as cps

    fake_world(0, 8)
    groups = build_megatron_groups(**TP2_PP2)
    try:
        assert not cps.model_parallel_is_initialized()
        assert cps._TENSOR_MODEL_PARALLEL_GROUP is None and cps._DATA_PARALLEL_GROUP_GLOO is None
        mps = pytest.importorskip("megatron.core.parallel_state")
        assert mps._TENSOR_MODEL_PARALLEL_GROUP is None and mps._DATA_PARALLEL_GROUP is None
        assert groups.group("dp_gloo") is None  # gloo twins only on request
    finally:
        groups.destroy()


def test_two_modules_side_by_side_and_leak_free_destroy(fake_world):
    fake_world(3, 8)
    before = _live_groups()
    a = build_megatron_groups(tensor_model_parallel_size=2)
    b = build_megatron_groups(tensor_model_parallel_size=4, order="tp-cp-ep-pp-dp")
    assert a.ranks("tp") == [2, 3] and b.ranks("tp") == [0, 1, 2, 3]
    assert a.group("dp") is not b.group("dp")
    assert a.destroy() > 0 and b.destroy() > 0
    assert _live_groups() == before
    assert a.destroy() == 0  # idempotent
    with pytest.raises(RuntimeError, match="were destroyed"):
        a.group("tp")


def test_rank_range_non_member_and_release_gate(fake_world, new_group_calls):
    fake_world(1, 12)
    outside = build_megatron_groups(**TP2_PP2, rank_offset=4, world_size=8, release="0.19")
    assert not outside.is_member and new_group_calls == []
    with pytest.raises(RuntimeError, match=r"rank 1 is not among this module's ranks 4\.\.11"):
        outside.field_values()
    fake_world(6, 12)
    inside = build_megatron_groups(**TP2_PP2, rank_offset=4, world_size=8, release="0.19")
    ranks = inside.field_ranks()
    assert ranks["tp"] == [6, 7] and ranks["pp"] == [6, 10] and ranks["dp"] == [4, 6]
    assert ranks["gtp_remat"] == [6] and ranks["dp_cp_ag"] is None  # 0.19 fields; all-gather unset as in MCore
    inside.destroy()
    with pytest.raises(TypeError, match=r"rank offset \(added in 0\.17\)"):
        build_megatron_groups(**TP2_PP2, rank_offset=4, world_size=8, release="0.16")


def test_older_release_has_no_collection(fake_world):
    fake_world(0, 4)
    with build_megatron_groups(tensor_model_parallel_size=2, release="0.14") as groups:
        assert groups.ranks("tp") == [0, 1]
        with pytest.raises(NoCollectionError, match="0.14 has no ProcessGroupCollection"):
            groups.collection()


def test_fields_of_every_release_come_from_the_kind_table():
    for series, fields in facts.COLLECTION_FIELDS.items():
        unknown = [f for f in fields if f not in FIELD_GLOBALS and not f.endswith("_ag")]
        assert not unknown, (series, unknown)


@pytest.mark.parametrize("world,rank", [(4096, 1234), (65536, 65535)])
def test_only_the_ranks_own_groups_are_created(world, rank, fake_world, new_group_calls):
    kwargs = {
        "tensor_model_parallel_size": 8,
        "pipeline_model_parallel_size": 4,
        "context_parallel_size": 2,
        "expert_model_parallel_size": 8,
    }
    fake_world(rank, world)
    layout = MegatronLayout(world_size=world, **kwargs)
    expected = [s.ranks for s in group_plan(layout, rank) if isinstance(s, CreateGroup) and s.backend != "gloo"]
    with build_megatron_groups(**kwargs) as groups:
        assert [sorted(c) for c in new_group_calls] == [sorted(r) for r in expected]
        assert all(rank in c for c in new_group_calls)
        assert groups.ranks("tp") == list(range(rank - rank % 8, rank - rank % 8 + 8))


@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_a_failure_leaves_nothing_behind(fail_at, fake_world, monkeypatch):
    fake_world(0, 16)
    before = _live_groups()
    original, count = dist.new_group, {"n": 0}

    def failing(*args, **kwargs):
        count["n"] += 1
        if count["n"] == fail_at:
            raise RuntimeError(f"injected failure at group {fail_at}")
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        build_megatron_groups(**TP2_PP2, context_parallel_size=2, expert_model_parallel_size=2)
    assert _live_groups() == before
    monkeypatch.setattr(dist, "new_group", original)
    with build_megatron_groups(**TP2_PP2) as groups:  # the next build works
        assert groups.ranks("tp") == [0, 1]
    assert _live_groups() == before


BAD_ARGUMENTS = [
    ({"tensor_model_parallel_size": 0}, ZeroDivisionError, "tensor_model_parallel_size must be >= 1, got 0"),
    ({"pipeline_model_parallel_size": -2}, AssertionError, "pipeline_model_parallel_size must be >= 1, got -2"),
    ({"context_parallel_size": True}, TypeError, "context_parallel_size must be an int"),
    ({"expert_model_parallel_size": 1.5}, TypeError, "expert_model_parallel_size must be an int"),
    ({"tensor_model_parallel_size": 3}, RuntimeError, "world_size \\(8\\) is not divisible"),
    ({"order": 7}, AttributeError, "order must be a str"),
    ({"order": "tp-dp-pp", "context_parallel_size": 2}, RuntimeError, "cp"),
    ({"distributed_timeout_minutes": 0}, ValueError, "distributed_timeout_minutes must be > 0"),
    ({"nccl_comm_cfgs": ["dp"]}, TypeError, "nccl_comm_cfgs must be a dict"),
    ({"pipeline_model_parallel_comm_backend": "mpi"}, ValueError, "pipeline_model_parallel_comm_backend"),
    ({"get_embedding_ranks": 3}, TypeError, "get_embedding_ranks must be callable"),
    ({"world_size": 16}, ValueError, "world_size \\(16\\) = 16 exceeds the 8 ranks"),
    ({"rank_offset": -1, "world_size": 4, "release": "0.19"}, ValueError, "rank_offset"),
    ({"hierarchical_context_parallel_sizes": [0]}, ZeroDivisionError, "hierarchical_context_parallel_sizes\\[0\\]"),
    ({"release": "0.11"}, ValueError, "0.11"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_ARGUMENTS, ids=[str(k) for k, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_fail_before_any_group(kwargs, error, message, fake_world, new_group_calls):
    fake_world(0, 8)
    with pytest.raises(error, match=message):
        build_megatron_groups(**kwargs)
    assert new_group_calls == []


def test_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_megatron_groups()


def test_repr_names_the_module_and_membership(fake_world):
    fake_world(1, 8)
    with build_megatron_groups(**TP2_PP2) as groups:
        assert isinstance(groups, MegatronGroups)
        text = repr(groups)
        assert "ranks 0..7" in text and "tp=2" in text and "pp=2" in text and "rank 1: member" in text


# --------------------------------------------------------------------------- gloo world of 4
def _reduce_every_field(kwargs: dict) -> dict:
    groups = build_megatron_groups(**kwargs)
    out = {}
    try:
        if kwargs.get("create_gloo_process_groups"):
            twin = groups.group("dp_gloo")
            out["dp_gloo"] = (dist.get_process_group_ranks(twin), dist.get_backend(twin))
        # the collection's fields; before 0.15 (no collection) the groups by kind
        values = groups.field_values() or {k: g for k, g in groups.state.groups.items() if not k.endswith("_gloo")}
        for name, group in values.items():
            if group is None or isinstance(group, list):
                continue
            members = dist.get_process_group_ranks(group)
            value = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(value, group=group)
            out[name] = (members, value.item())
    finally:
        groups.destroy()
    return out


def _build_outcome(kwargs: dict) -> dict:
    before = _live_groups()
    try:
        build_megatron_groups(**kwargs).destroy()
    except Exception as exc:  # the outcome is the point
        return {"error": type(exc).__name__, "message": str(exc), "leaked": _live_groups() - before}
    return {"error": None, "leaked": _live_groups() - before}


def test_every_field_reduces_over_its_members(gloo_world):
    world = gloo_world(4)
    kwargs = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "create_gloo_process_groups": True}
    results = world.run(_reduce_every_field, kwargs)
    for rank, fields in enumerate(results):
        assert "tp" in fields and "pp" in fields and "dp" in fields
        assert fields.pop("dp_gloo") == (fields["dp"][0], "gloo")
        for name, (members, total) in fields.items():
            assert rank in members, (rank, name)
            assert total == sum(m + 1 for m in members), (rank, name, members, total)


def test_ranks_that_disagree_all_raise(gloo_world):
    world = gloo_world(4)
    args = [({"tensor_model_parallel_size": 2},)] * 3 + [({"tensor_model_parallel_size": 4},)]
    outcomes = world.run_per_rank(_build_outcome, args, timeout=90)
    assert [o["error"] for o in outcomes] == [ParallelConfigMismatchError.__name__] * 4
    assert "tensor_model_parallel_size: 2 on ranks 0-2; 4 on rank 3" in outcomes[0]["message"]
    assert all(o["leaked"] == 0 for o in outcomes)
    assert [o["error"] for o in world.run(_build_outcome, {"tensor_model_parallel_size": 2})] == [None] * 4
