"""The split path's protocol on simulated worlds (fake backend; torch's split_group recorded).

On a world whose default group splits, every rank of the world must join the same sequence of
splits; members' colours must agree within a group and differ across groups; and each rank
must end with exactly the groups the member path gives it. Every rank of each world is played
in turn in this process; ``torch.distributed.split_group`` is replaced by a recorder that
creates the member's group on the fake backend (``PSNG_CREATION_PATH=split`` chooses the path:
the fake backend cannot split; :mod:`tests.support.worlds.split_recorder`). The same checks run
against every supported release in ``tests/releases/test_split_releases.py``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng import HyperCommGrid, build_megatron_groups, build_topology
from parallel_state_ng.groups.split import ENV_CREATION_PATH, creation_path
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, SplitOut, group_plan
from parallel_state_ng.layout.rebuild import plan_rebuild
from parallel_state_ng.layout.topology_spec import ModuleSpec
from tests.support.worlds.split_recorder import check_protocol, compare_paths, play_world


def compat_build(**kwargs):
    def build():
        ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        try:
            return dict(ps.get_state().ranks)
        finally:
            ps.destroy_model_parallel()

    return build


COMPAT_CONFIGS = [
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    (16, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 2}),
    (16, {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "expert_model_parallel_size": 2}),
    (16, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}),
    (16, {"tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 2, "order": "tp-cp-ep-pp-dp"}),
    (32, {"pipeline_model_parallel_size": 4, "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 2}),
]


@pytest.mark.parametrize("world,kwargs", COMPAT_CONFIGS)
def test_compat_init_splits_the_same_on_every_rank(world, kwargs):
    calls, ranks = play_world(world, compat_build(**kwargs))
    splits = check_protocol(calls, world)
    for rank in range(world):
        assert ranks[rank]["split"] == ranks[rank]["member"], f"rank {rank}: the paths give other groups"
    kinds = {key for r in ranks.values() for key in r["member"]}
    assert splits <= len(kinds), "at most one split per group kind"


def test_the_split_count_does_not_grow_with_the_world():
    counts = []
    for world in (8, 64):
        calls, _ = play_world(world, compat_build(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
        counts.append(check_protocol(calls, world))
    assert counts[0] == counts[1]


def test_a_module_on_part_of_the_world_splits_on_every_rank():
    def build():
        groups = build_megatron_groups(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, rank_offset=4, world_size=8, release="0.19"
        )
        try:
            return dict(groups.state.ranks) if groups.is_member else {}
        finally:
            groups.destroy()

    calls, ranks = play_world(16, build)
    check_protocol(calls, 16)
    assert all(calls[r] and all(c[4] is None for c in calls[r]) for r in (0, 3, 12, 15)), "outside: no colour"
    for rank in range(16):
        assert ranks[rank]["split"] == ranks[rank]["member"]


def _ranks_of(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


# (world, [(shape, dim names, rank offset, [dims sets]), ...]): grids on all and on part of the world
GRIDS = [
    (16, [([2, 4, 2], ["tp", "dp", "pp"], 0, ["tp", ["dp"], ["tp", "pp"], ["tp", "dp", "pp"]])]),
    (16, [([2, 2, 2], ["tp", "dp", "pp"], 4, ["tp", ["dp", "pp"], ["pp", "tp"]])]),
    (
        12,
        [
            ([2, 3], ["tp", "dp"], 0, ["dp", "tp"]),  # two grids in turn, the second on ranks 6-11
            ([3, 2], ["cp", "pp"], 6, ["pp", ["cp", "pp"]]),
        ],
    ),
]


@pytest.mark.parametrize("world,grids", GRIDS)
def test_hyper_comm_grid_splits_the_same_on_every_rank(world, grids):
    def build():
        made, out = [], {}
        try:
            for shape, names, offset, dims_sets in grids:
                grid = HyperCommGrid(shape, names, rank_offset=offset)
                made.append(grid)
                for dims in dims_sets:
                    out[f"{offset}:{dims}"] = _ranks_of(grid.create_pg(dims))
            return out
        finally:
            for grid in made:
                grid.destroy()

    calls, ranks = play_world(world, build)
    splits = check_protocol(calls, world)
    assert splits == sum(len(g[3]) for g in grids), "one split per create_pg"
    assert not compare_paths(ranks)
    for shape, _, offset, _ in grids:  # ranks outside a grid join its splits without a colour
        inside = range(offset, offset + math.prod(shape))
        for rank in (r for r in range(world) if r not in inside):
            assert all(v is None for k, v in ranks[rank]["split"].items() if k.startswith(f"{offset}:"))
    assert any(c[4] is None for r in range(world) for c in calls[r]) == any(
        g[2] or math.prod(g[0]) < world for g in grids
    )


def _topology_build(modules):
    def build():
        topology = build_topology(modules(), release="0.19")
        try:
            return {name: dict(topology.groups(name).state.ranks) for name in topology.modules_of_rank}
        finally:
            topology.destroy()

    return build


def _disjoint():
    return [
        ModuleSpec("vision", range(0, 4), tensor_model_parallel_size=2),
        ModuleSpec(
            "language", range(4, 16), tensor_model_parallel_size=2, pipeline_model_parallel_size=2, language=True
        ),
    ]


def _colocated():
    return [
        ModuleSpec("vision", range(0, 8), context_parallel_size=2),
        ModuleSpec(
            "language", range(0, 8), tensor_model_parallel_size=2, pipeline_model_parallel_size=2, language=True
        ),
    ]


@pytest.mark.parametrize("world,modules", [(16, _disjoint), (8, _colocated)], ids=["disjoint", "colocated"])
def test_build_topology_splits_the_same_on_every_rank(world, modules):
    calls, ranks = play_world(world, _topology_build(modules))
    check_protocol(calls, world)
    assert not compare_paths(ranks)
    assert all(ranks[r]["split"] for r in range(world)), "every rank runs a module"


@pytest.mark.parametrize("failed,keep", [([5], False), ([2, 13], False), ([5, 9], True)])
def test_a_rebuild_splits_the_same_on_every_rank(failed, keep):
    """The layout over the survivors (plan_rebuild), built on the split path over the new, smaller world."""
    old = MegatronLayout(
        world_size=20, local_world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, release="0.19"
    )
    plan = plan_rebuild(old, failed, keep_data_parallel=keep)
    assert plan.world_size < old.world_size

    def build():
        groups = build_megatron_groups(**plan.build_kwargs, release="0.19")
        try:
            return dict(groups.state.ranks) if groups.is_member else {}
        finally:
            groups.destroy()

    calls, ranks = play_world(plan.world_size, build)
    check_protocol(calls, plan.world_size)
    assert not compare_paths(ranks)
    spares = range(plan.layout_world_size, plan.world_size)
    assert all(ranks[r]["split"] == {} and all(c[4] is None for c in calls[r]) for r in spares)


@pytest.mark.parametrize("world", [8, 512, 4096])
def test_the_plan_lists_the_same_splits_for_every_rank(world):
    """Plan level, every rank of worlds up to 4,096: the same kinds in the same order, disjoint groups."""
    layout = MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=8 if world >= 512 else 2,
        pipeline_model_parallel_size=4 if world >= 512 else 2,
        context_parallel_size=2,
        expert_model_parallel_size=8 if world >= 512 else 2,
        release="0.19",
    )
    reference = None
    members: dict[int, dict[tuple, int]] = defaultdict(dict)
    for rank in range(world):
        steps = [s for s in group_plan(layout, rank, every_split=True) if isinstance(s, (CreateGroup, SplitOut))]
        split = [s for s in steps if getattr(s, "backend", None) is None]
        shape = [(s.key, s.desc, s.nccl_key, s.timeout) for s in split]
        if reference is None:
            reference = shape
        assert shape == reference, f"rank {rank}"
        for position, step in enumerate(split):
            if isinstance(step, CreateGroup):
                group = tuple(sorted(step.ranks))
                owner = members[position].setdefault(group, len(members[position]))
                assert rank in group and owner >= 0
    for position, groups in members.items():
        covered = [r for g in groups for r in g]
        assert len(covered) == len(set(covered)), f"split {position}: overlapping groups"


def test_creation_path_choice_and_bad_values(monkeypatch, fake_world):
    fake_world(0, 4)
    assert creation_path() == "member"  # the fake backend has no bound device
    assert creation_path("split") == "split"
    monkeypatch.setenv(ENV_CREATION_PATH, "split")
    assert creation_path() == "split" and creation_path("member") == "member"
    monkeypatch.setenv(ENV_CREATION_PATH, "eager")
    with pytest.raises(ValueError, match=r"PSNG_CREATION_PATH must be one of auto, member, split, got 'eager'"):
        creation_path()
    with pytest.raises(ValueError, match=r"creation_path must be one of auto, member, split, got 'both'"):
        creation_path("both")


def test_an_encoder_layout_is_refused_on_the_split_path():
    layout = MegatronLayout(  # the encoder (tp 1) feeds two decoder pipelines (tp 2)
        world_size=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        encoder_tensor_model_parallel_size=1,
        encoder_pipeline_model_parallel_size=2,
        release="0.13",
    )
    several = next(r for r in range(4) if len(layout.groups("pp", r)) > 1)
    with pytest.raises(ValueError, match="pipelines .* one split per group kind"):
        group_plan(layout, several, every_split=True)


@pytest.mark.parametrize("setting", ["1", "safe"])
def test_with_sharing_on_shared_groups_still_join_their_split(monkeypatch, setting):
    """With tp 1 and cp 1, dp_cp equals dp and tp_cp equals tp: a shared group's members join without a colour."""
    monkeypatch.setenv("PSNG_SHARE_GROUPS", setting)
    calls, results = play_world(8, compat_build(pipeline_model_parallel_size=2))
    splits = check_protocol(calls, 8)
    assert compare_paths(results) == []
    shared = [c for c in calls[0] if c[4] is None]
    assert shared, "some kinds reuse an earlier group: rank 0 joins their splits without a colour"
    assert splits == len(calls[0])


def test_abort_after_a_split_init_aborts_every_split_group(fake_world, monkeypatch):
    from parallel_state_ng.groups.abort import abort_groups
    from tests.support.worlds.split_recorder import SplitRecorder, creation_env, recording

    fake_world(5, 8)
    with recording(SplitRecorder()) as recorder, creation_env("split"):
        ps.initialize_model_parallel(
            create_gloo_process_groups=False, tensor_model_parallel_size=2, pipeline_model_parallel_size=2
        )
        made = [c for c in recorder.calls if c[4] is not None]
        result = abort_groups()
        assert result.aborted == len(made) > 0
        ps.destroy_model_parallel()  # after an abort: nothing left to do
    assert len(dist.distributed_c10d._world.pg_map) == 1


def test_a_forced_member_path_on_a_splitting_world_is_refused_before_any_group(monkeypatch, fake_world):
    from parallel_state_ng.groups import split

    fake_world(1, 8)
    monkeypatch.setattr(split, "world_splits", lambda: True)  # a default group bound to a device
    assert creation_path() == "split" and creation_path("split") == "split"
    with pytest.raises(split.MemberPathRefusedError, match=r"creation_path='member': the default process group splits"):
        creation_path("member")
    monkeypatch.setenv(ENV_CREATION_PATH, "member")
    before = set(dist.distributed_c10d._world.pg_map)
    with pytest.raises(ValueError, match=r"PSNG_CREATION_PATH=member: .*would hang.* Use 'auto' or 'split'"):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    with pytest.raises(split.MemberPathRefusedError):
        build_megatron_groups(tensor_model_parallel_size=2)
    with pytest.raises(split.MemberPathRefusedError):
        HyperCommGrid([2, 4], ["tp", "dp"])
    assert set(dist.distributed_c10d._world.pg_map) == before and not ps.model_parallel_is_initialized()
