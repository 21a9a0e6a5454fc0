"""The build pipeline's steps (parallel_state_ng.groups.pipeline) on simulated ranks.

The callers run agree, their own prepare, check_options and build in one direction; what
differs between them is where the agreement stands and whether a rank outside the layout gets
an empty state (compat) or nothing (build_megatron_groups).
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import pytest

from parallel_state_ng.groups.megatron_groups import destroy_model_groups
from parallel_state_ng.groups.pipeline import (
    SHARING_FIELD,
    Prepared,
    agree,
    build,
    check_options,
    layout_participants,
    nccl_config,
)
from parallel_state_ng.layout.init_args import InitArgs
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import PlanOptions
from tests.support.paths import ROOT


def _prepared(calls: list[str]) -> Prepared:
    calls.append("prepare")
    layout = MegatronLayout(
        world_size=16, tensor_model_parallel_size=2, rank_offset=8, local_world_size=8, release="0.19"
    )
    return Prepared(layout, timedelta(minutes=1), PlanOptions(create_gloo_process_groups=False), {})


def _steps(prepared: Prepared, agree_on: str, **kwargs):
    """The steps in the order the callers run them: agree (world or layout), check options, build."""
    agreed = agree({"tp": 2}, name="test") if agree_on == "world" else None
    check_options(prepared)
    if agree_on == "layout":
        agreed = agree({"tp": 2}, name="test", ranks=layout_participants(prepared.layout, "member"))
    return build(prepared, name="test", path="member", agreed=agreed, **kwargs)


@pytest.mark.parametrize("agree_on", ["world", "layout"])
def test_a_member_gets_exactly_its_plan_groups(fake_world, agree_on):
    fake_world(9, 16)
    calls: list[str] = []
    prepared = _prepared(calls)
    groups = _steps(prepared, agree_on)
    try:
        assert calls == ["prepare"] and groups is not None
        assert groups.ranks["tp"] == [8, 9] == prepared.layout.group("tp", 9)
        assert groups.ranks["dp"] == [9, 11, 13, 15]
    finally:
        destroy_model_groups(groups)


def test_outside_the_layout_nothing_or_an_empty_state(fake_world):
    fake_world(3, 16)
    assert _steps(_prepared([]), "layout") is None
    empty = _steps(_prepared([]), "world", empty_outside=True)
    assert empty is not None and empty.groups == {} and empty.created == []


def test_the_participants_of_a_layout_agreement():
    layout = _prepared([]).layout
    assert layout_participants(layout, "member") == range(8, 16)
    assert layout_participants(layout, "split") is None  # every rank of the world joins the splits


def test_check_options_refuses_before_any_group(fake_world):
    fake_world(0, 16)
    bad = _prepared([]).with_nccl_config({"tp": ["max_ctas", 4]}, source="the test's config")
    with pytest.raises(TypeError, match="the test's config: the options of group 'tp' must be a mapping"):
        check_options(bad)


def test_the_init_path_has_no_locals_snapshot_and_no_callback():
    """Compat's init and build_megatron_groups pass typed arguments down, one step after another."""
    for path in ("compat/_init.py", "parallel_state_ng/builders/collection.py", "parallel_state_ng/groups/pipeline.py"):
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        assert "locals()" not in text and "partial(_prepare" not in text, path
    assert [field.name for field in dataclasses.fields(InitArgs)][:2] == [
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
    ]


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
