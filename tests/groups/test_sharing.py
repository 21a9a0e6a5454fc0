"""Opt-in group sharing (``parallel_state_ng.groups.sharing``) and the destroy-time early-destroy guard.

Sharing: kinds with identical rank lists and identical creation options share one process
group; any differing option (backend as requested, pg_options, timeout) refuses sharing.
Checked on simulated ranks (fake backend: which getters return the same object, the
new_group count, destroy of each group once, atomic rollback) and on real gloo worlds (the
same members and the same all-reduce results as without sharing, refused sharing with real
groups, ranks that disagree on the setting fail the agreement check).

Guard: destroying a gloo group right after creating it waits for every member's readiness
mark (``parallel_state_ng.groups.creation``), and the wait is bounded when a member never marks.
"""

from __future__ import annotations

import json
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng.__main__ import main as cli_main
from parallel_state_ng.groups import creation, sharing
from parallel_state_ng.groups.factory import GroupFactory
from parallel_state_ng.releases import parallel_state as release_api
from tests.support.served import served

_WORLD = dist.distributed_c10d._world

# getter name, kwargs: every getter whose group exists with gloo twins and default options, in
# the served release (0.12 has no intra distributed-optimizer instance getter).
_ALL_GETTERS = [
    ("get_model_parallel_group", {}),
    ("get_tensor_model_parallel_group", {}),
    ("get_pipeline_model_parallel_group", {}),
    ("get_data_parallel_group", {}),
    ("get_data_parallel_group", {"with_context_parallel": True}),
    ("get_data_parallel_group_gloo", {}),
    ("get_data_parallel_group_gloo", {"with_context_parallel": True}),
    ("get_context_parallel_group", {}),
    ("get_tensor_and_data_parallel_group", {}),
    ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("get_tensor_and_context_parallel_group", {}),
    ("get_expert_model_parallel_group", {}),
    ("get_expert_tensor_parallel_group", {}),
    ("get_expert_tensor_and_model_parallel_group", {}),
    ("get_expert_tensor_model_pipeline_parallel_group", {}),
    ("get_expert_data_parallel_group", {}),
    ("get_expert_data_parallel_group_gloo", {}),
    ("get_intra_distributed_optimizer_instance_group", {}),
]
GETTERS = [(name, kw) for name, kw in _ALL_GETTERS if release_api.has(name, served())]


# --------------------------------------------------------------------------- settings and keys
def test_setting_override_and_environment(monkeypatch):
    monkeypatch.delenv(sharing.ENV_SHARE, raising=False)
    assert sharing.group_sharing_enabled() is False  # default off
    monkeypatch.setenv(sharing.ENV_SHARE, "1")
    assert sharing.group_sharing_enabled() is True
    previous = sharing.set_group_sharing(False)
    try:
        assert previous is None
        assert sharing.group_sharing_enabled() is False  # the function wins over the environment
    finally:
        sharing.set_group_sharing(previous)
    monkeypatch.setenv(sharing.ENV_SHARE, "maybe")
    with pytest.raises(ValueError, match="PSNG_SHARE_GROUPS"):
        sharing.group_sharing_enabled()
    with pytest.raises(TypeError):
        sharing.set_group_sharing(1)


def _nccl_like(high_priority: bool, max_ctas=None):
    return types.SimpleNamespace(
        is_high_priority_stream=high_priority,
        config=types.SimpleNamespace(cga_cluster_size=None, max_ctas=max_ctas, min_ctas=None, net_name=None),
    )


def test_options_key_compares_nccl_options_by_value_and_others_by_identity():
    assert sharing.options_key(None) is None
    assert sharing.options_key(_nccl_like(True)) == sharing.options_key(_nccl_like(True))
    assert sharing.options_key(_nccl_like(True)) != sharing.options_key(_nccl_like(False))
    assert sharing.options_key(_nccl_like(False, 4)) != sharing.options_key(_nccl_like(False))
    other = object()
    assert sharing.options_key(other) == sharing.options_key(other)
    assert sharing.options_key(other) != sharing.options_key(object())


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, ranks, **kwargs):
        self.calls.append((list(ranks), kwargs))
        return object()


REFUSED = {
    "backend": [dict(backend=None), dict(backend="gloo")],
    "timeout": [dict(timeout=timedelta(minutes=30)), dict(timeout=None)],
    "timeout value": [dict(timeout=timedelta(minutes=30)), dict(timeout=timedelta(minutes=10))],
    "high-priority stream": [dict(pg_options=_nccl_like(False)), dict(pg_options=_nccl_like(True))],
    "nccl config": [dict(pg_options=_nccl_like(False)), dict(pg_options=_nccl_like(False, 8))],
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_pool_refuses_sharing_across_differing_options(what):
    first, second = REFUSED[what]
    create = _Recorder()
    pool = sharing.GroupPool(share=True, create=create)
    a, new_a = pool.get([0, 1], **first)
    b, new_b = pool.get([0, 1], **second)
    assert new_a and new_b and a is not b and len(create.calls) == 2
    # the same request again is shared with the first
    c, new_c = pool.get([0, 1], **first)
    assert c is a and not new_c and len(create.calls) == 2


def test_pool_shares_only_identical_member_sets_and_only_when_on():
    create = _Recorder()
    pool = sharing.GroupPool(share=True, create=create)
    a, _ = pool.get([0, 1], group_desc="A")
    assert pool.get([0, 1], group_desc="B") == (a, False)
    assert pool.get([1, 0]) == (a, False)  # another order: the same members, one communicator (torch sorts)
    assert pool.get([0, 2])[0] is not a
    assert [c[1]["group_desc"] for c in create.calls] == ["A", None]
    off = sharing.GroupPool(share=False, create=_Recorder())
    x, _ = off.get([0, 1])
    y, new = off.get([0, 1])
    assert x is not y and new and off.created == 2


# --------------------------------------------------------------------------- simulated ranks
class _CountingNewGroup:
    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def _getter_groups():
    return [getattr(ps, name)(**kw) for name, kw in GETTERS if "gloo" not in name]


@pytest.mark.parametrize("rank", [0, 15])
def test_sharing_on_simulated_rank_same_members_fewer_groups(fake_world, monkeypatch, rank):
    fake_world(rank, 16)
    kwargs = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False)
    baseline = set(_WORLD.pg_map)
    counts, members, objects = {}, {}, {}
    for share in (False, True):
        monkeypatch.setattr(sharing, "_override", share)
        counter = _CountingNewGroup(dist.new_group)
        monkeypatch.setattr(dist, "new_group", counter)
        ps.initialize_model_parallel(**kwargs)
        monkeypatch.setattr(dist, "new_group", counter.real)
        groups = _getter_groups()
        members[share] = [dist.get_process_group_ranks(g) for g in groups]
        objects[share] = groups
        counts[share] = counter.calls
        created = ps.get_state().created
        assert len(created) == len({id(g) for g in created}) == counter.calls
        if "_global_process_group_list" in release_api.globals_of(served()):  # kept from 0.15 on
            assert ps._global_process_group_list == [None] + created  # a shared group listed once
        ps.destroy_model_parallel()
        assert set(_WORLD.pg_map) == baseline  # every group destroyed, each once
    assert members[True] == members[False]
    assert counts[True] < counts[False]
    by_name = dict(zip([(n, tuple(kw)) for n, kw in GETTERS if "gloo" not in n], range(len(GETTERS))))
    tp = by_name[("get_tensor_model_parallel_group", ())]
    tp_cp = by_name[("get_tensor_and_context_parallel_group", ())]
    assert objects[True][tp] is objects[True][tp_cp]  # cp = 1: tp x cp is tp
    assert objects[False][tp] is not objects[False][tp_cp]  # MCore's behaviour without sharing


def test_layout_tool_counts_match_a_real_init(fake_world, monkeypatch, capsys):
    argv = ["layout", "--world-size", "16", "--tp", "2", "--pp", "2", "--share", "--no-gloo-twins", "--format", "json"]
    assert cli_main(argv) == 0
    info = json.loads(capsys.readouterr().out)["report"]["communicators"]["ranks"]
    for rank in (0, 15):
        fake_world(rank, 16)
        for share, key in ((False, "without_sharing"), (True, "with_sharing")):
            monkeypatch.setattr(sharing, "_override", share)
            ps.initialize_model_parallel(
                tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
            )
            assert len(ps.get_state().created) == info[str(rank)][key], (rank, key)
            ps.destroy_model_parallel()
    assert info["0"]["with_sharing"] < info["0"]["without_sharing"]


class _FailingNewGroup:
    def __init__(self, real, fail_at):
        self.real, self.fail_at, self.calls = real, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected")
        return self.real(*args, **kwargs)


def test_rollback_with_sharing_leaves_nothing(fake_world, monkeypatch):
    fake_world(5, 16)
    monkeypatch.setattr(sharing, "_override", True)
    kwargs = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False)
    baseline = set(_WORLD.pg_map)
    ps.initialize_model_parallel(**kwargs)
    total = len(ps.get_state().created)
    ps.destroy_model_parallel()
    for fail_at in range(1, total + 1):
        failing = _FailingNewGroup(dist.new_group, fail_at)
        monkeypatch.setattr(dist, "new_group", failing)
        with pytest.raises(RuntimeError, match="injected"):
            ps.initialize_model_parallel(**kwargs)
        monkeypatch.setattr(dist, "new_group", failing.real)
        assert set(_WORLD.pg_map) == baseline and not ps.is_initialized(), fail_at
    ps.initialize_model_parallel(**kwargs)
    assert len(ps.get_state().created) == total
    ps.destroy_model_parallel()
    assert set(_WORLD.pg_map) == baseline


# --------------------------------------------------------------------------- gloo worlds
def _reduce_every_getter(share: bool, kwargs: dict) -> dict:
    sharing.set_group_sharing(share)
    before = set(_WORLD.pg_map)
    try:
        ps.initialize_model_parallel(**kwargs)
        out = []
        gloo = kwargs.get("create_gloo_process_groups", True)
        for name, kw in GETTERS:
            if "gloo" in name and not gloo:
                continue
            group = getattr(ps, name)(**kw)
            x = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(x, group=group)
            out.append((name, kw, dist.get_process_group_ranks(group), x.item()))
        live = len(set(_WORLD.pg_map) - before)
        created = len(ps.get_state().created)
    finally:
        ps.destroy_model_parallel()
        sharing.set_group_sharing(None)
    return {"results": out, "live": live, "created": created, "left": len(set(_WORLD.pg_map) - before)}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, create_gloo_process_groups=False),
    ],
    ids=["tp2pp2-gloo", "tp2ep2"],
)
def test_sharing_on_gloo_world_same_members_and_results(gloo_world, kwargs):
    world = gloo_world(4)
    plain = world.run(_reduce_every_getter, False, kwargs)
    shared = world.run(_reduce_every_getter, True, kwargs)
    for rank in range(4):
        assert shared[rank]["results"] == plain[rank]["results"], rank
        assert shared[rank]["live"] == shared[rank]["created"] < plain[rank]["live"] == plain[rank]["created"]
        assert shared[rank]["left"] == plain[rank]["left"] == 0  # destroy freed each group once


def _differing_options_on_gloo() -> dict:
    world_ranks = list(range(dist.get_world_size()))
    factory = GroupFactory(share=True)
    created = []
    try:
        a, _ = factory.group(world_ranks, timeout=timedelta(minutes=5))
        b, _ = factory.group(world_ranks, timeout=timedelta(minutes=6))
        c, _ = factory.group(world_ranks, backend="gloo", timeout=timedelta(minutes=5))
        d, new_d = factory.group(world_ranks, timeout=timedelta(minutes=5))
        created = [a, b, c]
        sums = []
        for group in created:
            x = torch.tensor([1.0])
            dist.all_reduce(x, group=group)
            sums.append(x.item())
        return {"distinct": len({id(a), id(b), id(c)}), "shared": d is a and not new_d, "sums": sums}
    finally:
        creation.destroy_groups(created)


def test_refused_sharing_creates_separate_working_groups(gloo_world):
    world = gloo_world(4)
    for result in world.run(_differing_options_on_gloo):
        assert result == {"distinct": 3, "shared": True, "sums": [4.0, 4.0, 4.0]}


def _init_with_sharing_on_rank_zero_only() -> str:
    sharing.set_group_sharing(dist.get_rank() == 0)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    except RuntimeError as exc:
        return type(exc).__name__ + ": " + str(exc)
    finally:
        sharing.set_group_sharing(None)
    ps.destroy_model_parallel()
    return "initialized"


def test_ranks_disagreeing_on_sharing_fail_the_agreement_check(gloo_world):
    world = gloo_world(4)
    for outcome in world.run(_init_with_sharing_on_rank_zero_only):
        assert outcome.startswith("ParallelConfigMismatchError") and "group sharing" in outcome


# --------------------------------------------------------------------------- early-destroy guard
def _destroy_right_after_a_late_peer(late_rank: int) -> bool:
    """``late_rank`` marks its readiness late; the others destroy at once. True: when our
    destroy returned, the late member's mark was in the store (the destroy waited for it).
    """
    import time

    real_mark = creation._mark_ready
    if dist.get_rank() == late_rank:

        def late(group, name, size):
            time.sleep(0.5)
            real_mark(group, name, size)

        creation._mark_ready = late
    try:
        group = creation.new_member_group(list(range(dist.get_world_size())), backend="gloo")
    finally:
        creation._mark_ready = real_mark
    store = creation._group_store(group)
    creation.destroy_groups([group])
    return store.check([f"{creation._READY_PREFIX}{late_rank}"])


def test_destroy_waits_for_every_member_to_finish_creating(gloo_world):
    world = gloo_world(4)
    assert world.run(_destroy_right_after_a_late_peer, 2) == [True] * 4


def _destroy_with_a_member_that_never_marks(silent_rank: int) -> int:
    import os

    real_mark = creation._mark_ready
    if dist.get_rank() == silent_rank:
        creation._mark_ready = lambda group, name, size: None
    os.environ[creation.ENV_SETTLE_TIMEOUT] = "0.2"
    try:
        group = creation.new_member_group(list(range(dist.get_world_size())), backend="gloo")
        x = torch.tensor([1.0])
        dist.all_reduce(x, group=group)  # every member finished creating: the group works
        done = creation.destroy_groups([group])
    finally:
        creation._mark_ready = real_mark
        del os.environ[creation.ENV_SETTLE_TIMEOUT]
    return done


def test_destroy_wait_is_bounded_when_a_member_never_marks(gloo_world):
    world = gloo_world(4)
    assert world.run(_destroy_with_a_member_that_never_marks, 1, timeout=60) == [1] * 4


# --------------------------------------------------------------------------- HyperCommGrid
def test_grid_shares_groups_of_equal_dims_sets_only_when_on(fake_world, monkeypatch):
    from parallel_state_ng import HyperCommGrid

    fake_world(3, 16)
    baseline = set(_WORLD.pg_map)
    for share in (False, True):
        monkeypatch.setattr(sharing, "_override", share)
        grid = HyperCommGrid([2, 1, 8], ["tp", "cp", "dp"])
        tp, tp_cp = grid.create_pg("tp"), grid.create_pg(["tp", "cp"])
        dp = grid.create_pg("dp")
        cp_dp = grid.create_pg(["cp", "dp"], timeout=timedelta(minutes=3))  # same members, other timeout
        assert dist.get_process_group_ranks(tp) == dist.get_process_group_ranks(tp_cp) == [2, 3]
        assert dist.get_process_group_ranks(dp) == dist.get_process_group_ranks(cp_dp)
        assert (tp is tp_cp) is share
        assert dp is not cp_dp
        grid.destroy()
        assert set(_WORLD.pg_map) == baseline
        again = grid.create_pg("tp")  # after destroy: a new, live group (not the destroyed shared one)
        assert again in _WORLD.pg_map and again is not tp
        grid.destroy()
        assert set(_WORLD.pg_map) == baseline
