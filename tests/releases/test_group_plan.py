"""The group plan: one table of group kinds read by everything, and one rank's creation steps.

The plan's steps are compared with each release's own creation sequence in
``layout_release_checks`` (per release, in that release's process); these tests check the table
itself and what reads it, in this process.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from parallel_state_ng.layout.kinds import ALL_GATHER_KINDS, GROUP_KINDS, fills, kind_exists
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, PlanOptions, SetCollnet, SharpBarrier, format_plan, group_plan
from parallel_state_ng.releases import SUPPORTED_SERIES
from parallel_state_ng.releases.facts import FACT_RANGES, release_facts
from parallel_state_ng.releases.parallel_state import globals_of
from tests.support import paths

ROOT = pathlib.Path(paths.ROOT)
PRODUCT = [*ROOT.joinpath("parallel_state_ng").rglob("*.py"), *ROOT.joinpath("compat").rglob("*.py")]


def _descs() -> set[str]:
    out = set()
    for kind in GROUP_KINDS.values():
        out.add(kind.desc.split("{")[0].rstrip("_L") if "{" in kind.desc else kind.desc)
        if kind.gloo_desc:
            out.add(kind.gloo_desc)
    return out


@pytest.mark.parametrize("desc", sorted(_descs()))
def test_each_group_desc_is_a_literal_in_one_product_file(desc):
    pattern = re.compile(r"[\"']" + re.escape(desc) + r"(_L\{level\}|_\{size\})?[\"']")
    files = [p.relative_to(ROOT).as_posix() for p in PRODUCT if pattern.search(p.read_text())]
    assert files == ["parallel_state_ng/layout/kinds.py"], files


def test_every_global_of_the_table_exists_in_a_release_and_fallbacks_are_globals():
    every = {name for series in SUPPORTED_SERIES for name in globals_of(series)}
    names = {fill.name for _, fill in fills()}
    assert names <= every, sorted(names - every)
    for _, fill in fills():
        if fill.fallback is not None:
            assert fill.fallback in names, fill
    fields = [fill.collection for _, fill in fills() if fill.collection]
    assert len(fields) == len(set(fields)), "a collection field is filled from two globals"


def test_kind_existence_reads_release_facts():
    assert not kind_exists("gtp_remat", release_facts("0.18")) and kind_exists("gtp_remat", release_facts("0.19"))
    assert kind_exists("inter_dp_cp", release_facts("0.12")) and not kind_exists("inter_dp_cp", release_facts("0.13"))
    assert [s for s in SUPPORTED_SERIES if kind_exists("dp_cp_ag", release_facts(s))] == [
        "0.16",
        "0.17",
        "0.18",
        "0.19",
    ]
    assert set(ALL_GATHER_KINDS) == {"dp_cp_ag", "ep_dp_ag"}
    for kind in GROUP_KINDS.values():
        assert set(kind.exists) <= set(FACT_RANGES), kind.name
        if kind.timeout_flipped_by:
            assert kind.timeout_flipped_by in FACT_RANGES, kind.name


def _layout(release: str, **sizes) -> MegatronLayout:
    return MegatronLayout(world_size=16, release=release, **sizes)


def test_plan_tp2_pp2_cp2_ep2_on_019_rank0():
    lay = _layout(
        "0.19",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=2,
        expert_model_parallel_size=2,
    )
    steps = group_plan(lay, 0, PlanOptions(create_gloo_process_groups=True))
    created = [s for s in steps if isinstance(s, CreateGroup)]
    assert [s.key for s in created] == [
        "gtp_remat",
        "dp_cp",
        "dp_cp_gloo",
        "dp",
        "dp_gloo",
        "cp",
        "mp",
        "tp",
        "pp",
        "embd",
        "pos_embd",
        "tp_dp_cp",
        "tp_dp",
        "tp_cp",
        "expt_gtp_remat",
        "ep",
        "ep_tp",
        "tp_ep_mp",
        "tp_ep_pp",
        "tp_ep_gtp_remat_pp",
        "ep_dp",
        "ep_dp_gloo",
        "intra_dist_opt_instance",
    ]
    by_key = {s.key: s for s in created}
    # MCore's default order tp-cp-ep-dp-pp: tp fastest, then cp, then dp (the expert view: tp-ep-dp-pp)
    assert by_key["tp"].ranks == [0, 1] and by_key["cp"].ranks == [0, 2] and by_key["dp"].ranks == [0, 4]
    assert by_key["pp"].ranks == [0, 8] and by_key["embd"].ranks == [0, 8] and by_key["pos_embd"].ranks == [0]
    assert by_key["dp_cp"].ranks == [0, 2, 4, 6] and by_key["ep"].ranks == [0, 2]
    assert by_key["dp_gloo"].backend == "gloo" and by_key["dp_gloo"].desc == "DATA_PARALLEL_GROUP_GLOO"
    assert by_key["ep"].timeout == "init" and by_key["ep_dp_gloo"].timeout == "torch"
    assert by_key["pp"].nccl_key == "pp" and by_key["dp_gloo"].nccl_key is None
    assert all(len(line) > 0 for line in format_plan(steps))


def test_plan_release_differences_are_the_facts():
    base = dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        num_distributed_optimizer_instances=2,
    )
    keys = {
        s: [st.key for st in group_plan(_layout(s, **base), 3) if isinstance(st, CreateGroup)] for s in ("0.12", "0.16")
    }
    assert keys["0.12"].index("dp") < keys["0.12"].index("dp_cp") and "inter_dp_cp" in keys["0.12"]
    assert keys["0.16"].index("dp_cp") < keys["0.16"].index("dp") and "inter_dp_cp" not in keys["0.16"]
    assert "intra_ep_dp_gloo" in keys["0.16"] and "intra_ep_dp" not in keys["0.12"]
    ep = {
        s: next(st for st in group_plan(_layout(s, **base), 3) if isinstance(st, CreateGroup) and st.key == "ep")
        for s in ("0.15", "0.16")
    }
    assert ep["0.15"].timeout == "torch" and ep["0.16"].timeout == "init"


def test_plan_sharp_steps_and_options():
    lay = _layout("0.16", tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    steps = group_plan(
        lay,
        0,
        PlanOptions(
            sharp_enabled_group="dp_replica", hybrid_context_parallel=True, pipeline_model_parallel_comm_backend="ucc"
        ),
    )
    kinds = [type(s).__name__ for s in steps]
    assert kinds.count("SetCollnet") == 1 and kinds.count("SharpBarrier") == 1
    collnet = kinds.index("SetCollnet")
    assert isinstance(steps[collnet + 1], CreateGroup) and steps[collnet + 1].key == "intra_ep_dp"
    barrier = next(s for s in steps if isinstance(s, SharpBarrier))
    assert barrier.key == "inter_ep_dp" and not barrier.legacy
    pp = next(s for s in steps if isinstance(s, CreateGroup) and s.key == "pp")
    assert pp.backend == "ucc" and pp.nccl_key is None
    hybrid = [s for s in steps if isinstance(s, CreateGroup) and s.kind == "hybrid_dp_cp"]
    assert [s.slot for s in hybrid] == lay.hybrid_group_sizes() and all(s.timeout == "torch" for s in hybrid)
    legacy = group_plan(
        _layout("0.13", num_distributed_optimizer_instances=2), 0, PlanOptions(sharp_enabled_group="dp")
    )
    assert not any(isinstance(s, SetCollnet) for s in legacy)
    assert [s for s in legacy if isinstance(s, SharpBarrier)] == [SharpBarrier("dp_cp", legacy=True)]


def test_plan_outside_the_layout_is_empty_and_kinds_read_the_plan():
    lay = MegatronLayout(world_size=16, local_world_size=8, rank_offset=8, tensor_model_parallel_size=2, release="0.17")
    assert group_plan(lay, 3) == []
    assert [s.key for s in group_plan(lay, 9) if isinstance(s, CreateGroup) and s.backend is None] == lay.kinds()
