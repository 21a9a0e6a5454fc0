"""``verify_groups`` on simulated ranks (torch's fake backend, one process): scale and locality.

On the fake backend an all-gather hands a rank its own object back once per rank, so
``verify_groups`` runs end to end as if every rank had found what this one found. At 65,536
ranks it must never loop over the world: ``MegatronLayout.enumerate`` (the O(world) listing)
is made to fail, and the rank's expected groups come from its own group plan. The exchange
between real processes, the traps and the bad-input table are in
``tests/builders/test_verify_gloo.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from parallel_state_ng import HyperCommGrid, build_megatron_groups, verify_groups
from parallel_state_ng.builders.verify import TRAPS, Mismatch, check_rank_groups
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.releases import SUPPORTED_SERIES
from tests.support.served import has_collection, skip_unless

BIG: dict = {
    "tensor_model_parallel_size": 8,
    "pipeline_model_parallel_size": 4,
    "context_parallel_size": 2,
    "expert_model_parallel_size": 8,
}


@pytest.fixture
def no_world_loop(monkeypatch):
    """Make every O(world) listing of a layout fail."""

    def refuse(self, kind):
        raise AssertionError(f"verify_groups listed every {kind!r} group of the world")

    monkeypatch.setattr(MegatronLayout, "enumerate", refuse)


@pytest.mark.parametrize("rank", [40_961, 65_535])
def test_65536_ranks_end_to_end_without_a_world_loop(rank, fake_world, no_world_loop):
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    fake_world(rank, 65_536)
    with build_megatron_groups(**BIG) as groups:
        report = verify_groups(groups, **BIG)
        assert report.ok and report.world_size == 65_536
        assert report.checked == 65_536 * check_rank_groups(groups, **BIG).checked  # every "rank" reported
        swapped = {**groups.field_values(), "tp": groups.group("dp")}
        check = check_rank_groups(swapped, **BIG)
    (finding,) = check.mismatches
    assert (finding.rank, finding.where, finding.trap) == (rank, "field 'tp'", "other_layout")
    tp0 = rank - rank % 8
    assert finding.expected == tuple(range(tp0, tp0 + 8))
    assert "that is this layout's 'dp' group" in finding.message()


def test_a_grid_at_65536_ranks(fake_world, no_world_loop):
    fake_world(12_345, 65_536)
    grid = HyperCommGrid([8, 2, 1024, 4], ["tp", "cp", "dp", "pp"])
    for dims in ("tp", ["dp", "cp"], "pp", ["tp", "cp"]):
        grid.create_pg(dims)
    check = check_rank_groups(grid, **BIG)
    assert check.checked == 4 and check.mismatches == []
    other = check_rank_groups(grid, **{**BIG, "expert_model_parallel_size": 2, "order": "tp-cp-ep-pp-dp"})
    assert {m.where for m in other.mismatches} == {"grid group 'dp-cp'", "grid group 'pp'"}
    grid.destroy()


def test_compat_module_globals_match_locally(fake_world):
    import compat.parallel_state as cps

    fake_world(5, 16)
    cfg = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 2}
    cps.initialize_model_parallel(**cfg, create_gloo_process_groups=False)
    try:
        check = check_rank_groups(cps, **cfg)
        assert check.mismatches == [] and check.checked > 30  # the groups and the rank lists
        wrong = check_rank_groups(cps, **{**cfg, "context_parallel_size": 1})
        assert {m.where for m in wrong.mismatches} >= {"global _CONTEXT_PARALLEL_GROUP", "global _DATA_PARALLEL_GROUP"}
    finally:
        cps.destroy_model_parallel()


def test_every_trap_has_a_message():
    for trap in TRAPS:
        text = Mismatch(3, "field 'tp'", "tp", trap, (2, 3), (0, 1, 2, 3)).message()
        assert text.startswith("rank 3: field 'tp' (kind 'tp')") and len(text) > 40


def test_hierarchical_levels_are_compared_level_by_level(fake_world):
    import compat.parallel_state as cps

    fake_world(6, 16)
    cfg = {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}
    cps.initialize_model_parallel(**cfg, create_gloo_process_groups=False)
    try:
        assert check_rank_groups(cps, **cfg).mismatches == []
        (wrong,) = check_rank_groups(cps, **{**cfg, "hierarchical_context_parallel_sizes": [4, 1]}).mismatches
    finally:
        cps.destroy_model_parallel()
    assert wrong.message() == (
        "rank 6: global _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS level 0 (kind 'hcp') holds group [6, 7], "
        "but this layout's group for the rank is [4, 5, 6, 7]"
    )


def test_releases_without_a_collection(fake_world):
    fake_world(6, 16)
    cfg = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    with build_megatron_groups(**cfg, release="0.14") as groups:
        by_kind = check_rank_groups(groups, release="0.14", **cfg)  # MegatronGroups: its groups by kind
        assert by_kind.mismatches == [] and by_kind.checked == len(groups.state.ranks)
        moved = check_rank_groups(groups, release="0.14", **{**cfg, "order": "tp-cp-ep-pp-dp"}).mismatches
        assert {m.where: m.message() for m in moved}["group 'dp'"] == (
            "rank 6: group 'dp' (kind 'dp') holds group [0, 2, 4, 6], but this layout's group for the rank is "
            "[2, 6, 10, 14]; that is the 'dp' group under order='tp-cp-ep-dp-pp'"
        )
        with pytest.raises(ValueError, match=r"megatron-core 0.14 has no ProcessGroupCollection \(added in 0.15\)"):
            check_rank_groups({"tp": groups.group("tp")}, release="0.14", **cfg)


def test_nothing_to_check_is_an_error(fake_world):
    fake_world(0, 4)
    with build_megatron_groups(tensor_model_parallel_size=2) as groups:
        with pytest.raises(ValueError, match=r"nothing to check: this MegatronGroups .*\(fields=\[\]\)"):
            check_rank_groups(groups, fields=[], tensor_model_parallel_size=2)


@pytest.mark.parametrize("release", SUPPORTED_SERIES)
def test_flattened_grid_and_mesh_dims_name_their_kind_on_every_release(release, fake_world):
    # 0.19's tp_dp and mp span gtp_remat too: a dim without it is the kind at gtp_remat size 1
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(5, 8)
    cfg = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    for dims in ("tp", "dp", "pp", ["dp", "tp"], ["tp", "pp"]):
        grid.create_pg(dims)
    try:
        check = check_rank_groups(grid, release=release, **cfg)
    finally:
        grid.destroy()
    assert check.checked == 5 and check.mismatches == []
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    mesh["dp", "tp"]._flatten("dp_tp")
    check = check_rank_groups(mesh, release=release, **cfg)
    assert check.checked == 4 and check.mismatches == []
    moved = check_rank_groups(mesh, release=release, **{**cfg, "order": "dp-tp-cp-ep-pp"})
    assert {m.where for m in moved.mismatches} == {"mesh dim 'tp'", "mesh dim 'dp'"}  # dp x tp: the same ranks


def test_an_unset_field_is_missing_even_where_the_collection_reads_it_as_none(fake_world):
    # 0.19's ProcessGroupCollection answers None for a declared field never set (its __getattr__)
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    fake_world(1, 4)

    @dataclasses.dataclass(init=False)
    class Collection019:
        tp: Any = dataclasses.field(init=False)
        dp: Any = dataclasses.field(init=False)
        mp: Any = dataclasses.field(init=False)

        def __init__(self, **groups: Any) -> None:
            for name, group in groups.items():
                setattr(self, name, group)

        def __getattr__(self, name: str) -> Any:
            if name in {f.name for f in dataclasses.fields(type(self))}:
                return None
            raise AttributeError(name)

    with build_megatron_groups(tensor_model_parallel_size=2) as groups:
        values = groups.field_values()
        partial = Collection019(tp=values["tp"], dp=values["dp"])
        assert partial.mp is None
        found = check_rank_groups(partial, fields=["tp", "dp", "mp"], tensor_model_parallel_size=2)
    assert [(m.where, m.trap) for m in found.mismatches] == [("field 'mp'", "missing")]
