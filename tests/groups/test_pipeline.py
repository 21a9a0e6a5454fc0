"""The one build pipeline (parallel_state_ng.groups.pipeline) on simulated ranks.

What its callers differ in are parameters: where the agreement check stands, and whether a
rank outside the layout gets an empty state (compat) or nothing (build_megatron_groups).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from parallel_state_ng.groups.megatron_groups import destroy_model_groups
from parallel_state_ng.groups.pipeline import SHARING_FIELD, Prepared, agree, build_layout_groups, nccl_config
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import PlanOptions


def _prepared(calls: list[str]) -> Prepared:
    calls.append("prepare")
    layout = MegatronLayout(
        world_size=16, tensor_model_parallel_size=2, rank_offset=8, local_world_size=8, release="0.19"
    )
    return Prepared(layout, timedelta(minutes=1), PlanOptions(create_gloo_process_groups=False), {})


@pytest.mark.parametrize("agree_on", ["world", "layout"])
def test_a_member_gets_exactly_its_plan_groups(fake_world, agree_on):
    fake_world(9, 16)
    calls: list[str] = []
    layout, groups = build_layout_groups(
        lambda: _prepared(calls), name="test", agreement_fields={"tp": 2}, agree_on=agree_on
    )
    try:
        assert calls == ["prepare"] and groups is not None
        assert groups.ranks["tp"] == [8, 9] == layout.group("tp", 9)
        assert groups.ranks["dp"] == [9, 11, 13, 15]
    finally:
        destroy_model_groups(groups)


def test_outside_the_layout_nothing_or_an_empty_state(fake_world):
    fake_world(3, 16)
    _, nothing = build_layout_groups(lambda: _prepared([]), name="test", agreement_fields={}, agree_on="layout")
    assert nothing is None
    _, empty = build_layout_groups(
        lambda: _prepared([]), name="test", agreement_fields={}, agree_on="world", empty_outside=True
    )
    assert empty is not None and empty.groups == {} and empty.created == []


def test_the_caller_validates_before_anything_is_created(fake_world):
    fake_world(0, 16)

    def refuse() -> Prepared:
        raise ValueError("tensor_model_parallel_size=3 does not divide 16")

    with pytest.raises(ValueError, match="does not divide"):
        build_layout_groups(refuse, name="test", agreement_fields={}, agree_on="world")
    with pytest.raises(ValueError, match="agree_on must be 'world' or 'layout', got 'both'"):
        build_layout_groups(refuse, name="test", agreement_fields={}, agree_on="both")  # type: ignore[arg-type]


def test_agree_is_skipped_on_the_fake_backend_and_when_off(fake_world):
    fake_world(0, 4)
    result = agree({"tp": 2}, name="test")
    assert result is not None and result.skipped and "fake backend" in result.reason
    assert agree({"tp": 2}, name="test", enabled=False) is None
    assert SHARING_FIELD == "group sharing (PSNG_SHARE_GROUPS)"


def test_nccl_config_copies_and_adds_high_priority_streams():
    given = {"dp": {"max_ctas": 4}}
    cfgs = nccl_config(given, ["tp", "dp"])
    assert cfgs == {"dp": {"max_ctas": 4, "is_high_priority_stream": True}, "tp": {"is_high_priority_stream": True}}
    assert given == {"dp": {"max_ctas": 4}}
