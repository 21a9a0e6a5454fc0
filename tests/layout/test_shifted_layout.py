"""``shifted``: a layout moved to other ranks equals one built there, group for group.

The topology tools build one :class:`MegatronLayout` per module shape and shift it to each
module's first rank (``MegatronLayout.shifted``, ``Layout.shifted``). Hypothesis draws
configurations of releases 0.17, 0.18 and 0.19 (tensor, pipeline, context, expert, expert
tensor, data-parallel and GTP sizes, orders, distributed-optimizer instances, hierarchical
context-parallel levels) and two offsets; the shifted layout is compared with a fresh one on
every kind's enumeration, on ranks' groups of every kind (spread, and at the edges), and attribute by attribute.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.named_layout import Layout

SETTINGS = settings(
    max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp-cp-ep", "tp-dp-cp-ep-pp", "cp-tp-ep-dp-pp"]
ALL_GATHER = ("dp_cp_ag", "ep_dp_ag")


@st.composite
def configs(draw: st.DrawFn) -> dict:
    release = draw(st.sampled_from(["0.17", "0.18", "0.19"]))
    tp, pp, cp, dp = (draw(st.sampled_from(values)) for values in ([1, 2, 4], [1, 2, 3], [1, 2, 4], [1, 2, 3]))
    gtp = draw(st.sampled_from([1, 2])) if release == "0.19" else 1
    args = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": draw(st.sampled_from([1, 2, 4])),
        "expert_tensor_parallel_size": draw(st.sampled_from([None, 1, 2])),
        "order": draw(st.sampled_from(ORDERS)),
        "num_distributed_optimizer_instances": draw(st.sampled_from([1, 1, 2])),
        "release": release,
    }
    if release == "0.19":
        args["gtp_remat_size"] = gtp
        args["expert_gtp_remat_size"] = draw(st.sampled_from([1, 2]))
    if cp > 1 and draw(st.booleans()):
        args["hierarchical_context_parallel_sizes"] = [2, cp // 2]
    args["local_world_size"] = tp * pp * cp * dp * gtp
    return args


def build(args: dict, offset: int, world_size: int) -> MegatronLayout:
    return MegatronLayout(world_size=world_size, rank_offset=offset, **args)


def some_groups(layout: MegatronLayout, kinds: list[str]) -> dict:
    """Groups of ranks spread over the world and at both edges of the layout (inside and out)."""
    start, stop = layout.rank_offset, layout.rank_offset + layout.layout_world_size
    ranks = set(range(0, layout.world_size, max(1, layout.world_size // 12))) | {start - 1, start, stop - 1, stop}
    return {(kind, r): layout.group(kind, r) for kind in kinds for r in sorted(ranks) if 0 <= r < layout.world_size}


@SETTINGS
@given(configs(), st.integers(0, 40), st.integers(0, 40))
def test_shifted_equals_a_layout_built_there(args, first, second):
    world_size = max(first, second) + args["local_world_size"] + 3  # ranks outside on both sides
    try:
        base = build(args, first, world_size)
    except (ValueError, AssertionError, RuntimeError, KeyError, TypeError):
        assume(False)
    fresh = build(args, second, world_size)  # every check passed at the first offset: none depends on it
    moved = base.shifted(second)
    assert moved == fresh
    kinds = fresh.kinds()
    assert moved.kinds() == kinds
    with_all_gather = kinds + list(ALL_GATHER if args["release"] != "0.17" else ("dp_cp_ag",))
    for kind in with_all_gather:
        assert moved.enumerate(kind) == fresh.enumerate(kind), kind
    assert some_groups(moved, with_all_gather) == some_groups(fresh, with_all_gather)
    for size in fresh.hybrid_group_sizes():
        assert moved.hybrid_group(second, size) == fresh.hybrid_group(second, size)
    skip = {"_all_gather"}  # a cache, filled on request
    assert {k: v for k, v in vars(moved).items() if k not in skip} == {
        k: v for k, v in vars(fresh).items() if k not in skip
    }
    assert base.rank_offset == first and base.enumerate("tp") == build(args, first, world_size).enumerate("tp")


def test_shifted_refuses_what_the_constructor_refuses():
    args = {"tensor_model_parallel_size": 2, "local_world_size": 4, "release": "0.19"}
    layout = build(args, 0, 8)
    with pytest.raises(ValueError, match="exceeds world_size"):
        layout.shifted(6)
    with pytest.raises(ValueError, match="rank_offset must be >= 0"):
        layout.shifted(-1)
    whole = MegatronLayout(world_size=8, tensor_model_parallel_size=2, release="0.16")
    assert whole.shifted(0) == whole
    with pytest.raises(TypeError, match="added in 0.17"):
        whole.shifted(2)  # 0.16 has no rank offsets


def test_shifted_encoder_block_0_13():
    """0.13's encoder block moves with the layout (offset 0 only: that release has no rank offsets)."""
    layout = MegatronLayout(
        world_size=12,
        tensor_model_parallel_size=2,
        encoder_pipeline_model_parallel_size=1,
        num_distributed_optimizer_instances=1,
        release="0.13",
    )
    moved = layout.shifted(0)
    assert moved is not layout and moved.encoder_block is not layout.encoder_block
    for kind in layout.kinds():
        assert moved.enumerate(kind) == layout.enumerate(kind), kind


@pytest.mark.parametrize(
    "sizes,names,merged,split_sizes",
    [
        ([2, 3, 4], ["tp", "cp", "dp"], ["cp", "dp"], [6, 2]),  # adjacent: a plain layout
        ([2, 3, 2, 4], ["tp", "cp", "pp", "dp"], ["cp", "dp"], [4, 3]),  # composed: through its parent
        ([4, 2], ["cp", "dp"], ["cp"], [2, 2]),
    ],
)
def test_layout_shifted_plain_and_split(sizes, names, merged, split_sizes):
    for first, second in [(0, 5), (7, 0), (3, 3)]:
        split = Layout(sizes, names, first).split(merged, split_sizes, ["a", "b"])
        moved = split.shifted(second)
        fresh = Layout(sizes, names, second).split(merged, split_sizes, ["a", "b"])
        assert moved == fresh and moved.is_plain == fresh.is_plain
        for k in range(len(fresh.names) + 1):
            for dims in itertools.combinations(fresh.names, k):
                assert moved.rank_enum(dims) == fresh.rank_enum(dims), dims
        assert [moved.coord(r) for r in range(second, second + fresh.size)] == [
            fresh.coord(r) for r in range(second, second + fresh.size)
        ]
    with pytest.raises(ValueError, match="over the limit"):
        Layout(sizes, names).shifted(2**62)
