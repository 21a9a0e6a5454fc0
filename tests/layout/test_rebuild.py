"""plan_rebuild: the layout over the survivors (pure math, large simulated worlds, no processes)."""

from __future__ import annotations

import random

import pytest
import torch

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.rebuild import RebuildError, plan_rebuild


def _shard(layout: MegatronLayout, ranks: torch.Tensor) -> torch.Tensor:
    """What a rank's parameters are: its dense (tp, cp, pp) and expert (etp, ep, pp) position."""
    local = ranks - layout.rank_offset  # coordinates from the dims, first varies fastest
    out = []
    for lay, dims in ((layout.decoder, ("tp", "cp", "pp")), (layout.expert, ("tp", "ep", "pp"))):
        stride, coords = 1, {}
        for name, size in zip(lay.dim_names, lay.shape, strict=True):
            coords[name] = (local // stride) % size
            stride *= size
        out.extend(coords[n] for n in dims)
    return torch.stack(out, dim=1)


def _check(old: MegatronLayout, failed: list[int], **kwargs) -> None:
    plan = plan_rebuild(old, failed, **kwargs)
    kw = dict(plan.initialize_kwargs)
    local = kw.pop("local_world_size", None)
    new = MegatronLayout(world_size=plan.world_size, local_world_size=local, release="0.19", **kw)
    assert new.layout_world_size == plan.layout_world_size
    assert new.data_parallel_size == plan.data_parallel_size
    assert plan.new_rank[torch.tensor(failed, dtype=torch.int64)].eq(-1).all()
    alive_new = plan.new_rank[plan.new_rank >= 0]
    assert sorted(alive_new.tolist()) == list(range(plan.world_size))  # a renumbering, no gaps
    inside = torch.arange(plan.layout_world_size)
    sources = plan.source[inside]
    assert not torch.isin(sources, torch.tensor(failed)).any()  # state comes from the living
    # the state a new rank needs is the shard at its position: same tp/cp/pp and etp/ep/pp coordinates
    assert torch.equal(_shard(old, sources), _shard(new, inside))
    assert plan.source[plan.layout_world_size :].eq(-1).all()
    if not kwargs.get("keep_data_parallel"):
        assert plan.moves() == 0  # survivors keep their own state


@pytest.mark.parametrize(
    "sizes",
    [
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2),
        dict(tensor_model_parallel_size=1, expert_model_parallel_size=4),
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-cp-ep-pp-dp"),
        dict(tensor_model_parallel_size=4, context_parallel_size=2, expert_model_parallel_size=8, order="tp-pp-dp"),
    ],
)
def test_shrink_keeps_positions_and_shards(sizes):
    world = 256
    if "order" in sizes and "cp" not in sizes["order"]:
        sizes = {**sizes, "context_parallel_size": 1, "expert_model_parallel_size": 1}
    old = MegatronLayout(world_size=world, release="0.19", **sizes)
    rng = random.Random(1)
    for count in (1, 3, 7):
        failed = rng.sample(range(world), count)
        try:
            _check(old, failed)
        except RebuildError as err:
            assert "no complete model replica survives" in str(err)
        _check(old, failed, keep_spares=False)


def test_unit_size_with_experts():
    # ep 4 x etp 1 does not divide tp 1: 4 consecutive dp replicas hold one set of experts
    old = MegatronLayout(world_size=16, expert_model_parallel_size=4, release="0.19")
    plan = plan_rebuild(old, [5])
    assert plan.unit_size == 4 and plan.data_parallel_size == 12 and plan.kept_units == (0, 2, 3)
    assert plan.layout_world_size == 12 and plan.world_size == 15


def test_keep_data_parallel_with_spares():
    old = MegatronLayout(
        world_size=20, local_world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, release="0.19"
    )
    plan = plan_rebuild(old, [5, 9], keep_data_parallel=True)
    assert plan.data_parallel_size == old.data_parallel_size and plan.layout_world_size == 16
    assert plan.new_rank_of(16) == 5 and plan.new_rank_of(17) == 9  # the spares take the dead places
    assert plan.source_of(5) not in (5, 9) and plan.moves() == 2
    assert plan.world_size == 18 and plan.initialize_kwargs["local_world_size"] == 16
    build = plan.build_kwargs  # build_megatron_groups takes the module's ranks as world_size
    assert build["world_size"] == 16 and "local_world_size" not in build
    assert {k: v for k, v in build.items() if k != "world_size"} == {
        k: v for k, v in plan.initialize_kwargs.items() if k != "local_world_size"
    }
    _check(old, [5, 9], keep_data_parallel=True)
    with pytest.raises(RebuildError, match="spare"):
        plan_rebuild(old, [1, 2, 3, 5, 9], keep_data_parallel=True)


def test_no_complete_replica_is_refused():
    old = MegatronLayout(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, release="0.19")
    # ranks 0 and 3: tp0/pp0 of replica 0 and tp1/pp0 of replica 1
    with pytest.raises(RebuildError, match=r"no complete model replica survives: failed ranks \[0, 3\]"):
        plan_rebuild(old, [0, 3])
    with pytest.raises(RebuildError, match="outside the old world"):
        plan_rebuild(old, [8])


def test_distributed_optimizer_instances_must_divide():
    old = MegatronLayout(world_size=8, num_distributed_optimizer_instances=2, release="0.19")
    with pytest.raises(RebuildError, match="num_distributed_optimizer_instances=2"):
        plan_rebuild(old, [0])  # dp 8 -> 7


@pytest.mark.slow
@pytest.mark.parametrize("world", [65_536, 1_048_576])
def test_large_worlds(world):
    old = MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=8,
        context_parallel_size=2,
        expert_model_parallel_size=8,
        release="0.19",
    )
    failed = [3, world // 3, world - 1]
    plan = plan_rebuild(old, failed)
    assert plan.world_size == world - 3
    assert plan.data_parallel_size == old.data_parallel_size - 3 * plan.unit_size
    if world <= 65_536:
        _check(old, failed)
