"""The sharing policy by role (``PSNG_SHARE_GROUPS=safe``) and the all-gather twins under ``1`` / ``process``.

One test per rule of :mod:`parallel_state_ng.layout.sharing_policy`, on a pool (requests named
by their kinds' ``group_desc``, as the build names them) and on simulated ranks through compat's
``initialize_model_parallel`` (which getters return one object); the twin fix under ``1`` and
``process``; the layout tool's ``--share`` report. Real gloo training under ``safe``:
tests/integration/test_train_gpt.py.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng.__main__ import main as cli_main
from parallel_state_ng.groups import registry, sharing
from parallel_state_ng.layout import sharing_policy as policy
from parallel_state_ng.layout.kinds import ALL_GATHER_KINDS, GROUP_KINDS
from tests.support.paths import ROOT
from tests.support.served import served_facts, skip_unless

ROOT_DOCS = Path(ROOT) / "docs"

T30 = timedelta(minutes=30)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, ranks, **kwargs):
        self.calls.append(list(ranks))
        return object()


def _desc(kind: str) -> str:
    return GROUP_KINDS[kind].desc.replace("{level}", "0").replace("{size}", "4")


def _pool(mode: str) -> sharing.GroupPool:
    return sharing.GroupPool(share=mode, create=_Recorder())


def _same(mode: str, a: str, b: str, ranks=(0, 2, 4, 6), **options) -> bool:
    """Whether two requests of kinds ``a`` and ``b`` over ``ranks`` get one group under ``mode``."""
    pool = _pool(mode)
    try:
        first, _ = pool.get(list(ranks), group_desc=_desc(a), timeout=T30, **options)
        second, _ = pool.get(list(ranks), group_desc=_desc(b), timeout=T30, **options)
    finally:
        registry.forget([group for _, group, _ in registry.entries()])  # stand-in groups: nothing to destroy
    return first is second


# --------------------------------------------------------------------------- the data
def test_policy_is_data_over_the_kind_table():
    named = {kind for rule in policy.ROLES + policy.NEVER_SHARED for kind in rule.kinds}
    assert named <= set(GROUP_KINDS)  # every rule names real kinds
    in_roles = [kind for rule in policy.ROLES for kind in rule.kinds]
    assert len(in_roles) == len(set(in_roles))  # a kind has one role
    assert not set(in_roles) & {kind for rule in policy.NEVER_SHARED for kind in rule.kinds}
    assert all(rule.reason for rule in policy.SAFE_SHARING + policy.NEVER_SHARED)
    assert policy.ALL_GATHER_RULE.kinds == ALL_GATHER_KINDS
    for kind in GROUP_KINDS.values():  # every group_desc (and gloo twin's) names its kind
        assert policy.kind_of_desc(_desc(kind.name)) == kind.name
        if kind.gloo_desc:
            assert policy.kind_of_desc(kind.gloo_desc.replace("{level}", "1")) == kind.name
    assert policy.kind_of_desc("SOMETHING_ELSE") is None and policy.kind_of_desc(None) is None


def test_switch_value_safe(monkeypatch):
    monkeypatch.setenv(sharing.ENV_SHARE, "safe")
    assert sharing.group_sharing_mode() == "safe" and sharing.group_sharing_enabled()
    monkeypatch.delenv(sharing.ENV_SHARE)  # unset: the path decides
    assert not sharing.group_sharing_enabled() and sharing.group_sharing_enabled("split")
    monkeypatch.setenv(sharing.ENV_SHARE, "0")
    assert not sharing.group_sharing_enabled("split")
    monkeypatch.setenv(sharing.ENV_SHARE, "safest")
    with pytest.raises(ValueError, match="0, safe, 1 or process"):
        sharing.group_sharing_mode()


# --------------------------------------------------------------------------- one test per rule
@pytest.mark.parametrize("role", policy.ROLES, ids=lambda r: r.name)
def test_aliases_of_one_role_share(role):
    for a in role.kinds:
        for b in role.kinds:
            assert _same("safe", a, b), (a, b)


@pytest.mark.parametrize(
    "a, b",
    [
        ("dp_cp", "ep"),  # tp2 pp2 ep2 on 8 ranks: the reduce-scatter beside the all-to-all
        ("tp", "ep"),  # etp 1, ep = tp: EP-overlap / shared-expert overlap
        ("tp", "ep_tp"),  # expert tp = tp
        ("dp_cp", "ep_dp"),  # ep 1, etp = tp: expert dp = dense dp
        ("mp", "tp_ep_pp"),  # ChainedOptimizer's combined grad-norm branch
        ("gtp_remat", "expt_gtp_remat"),  # GTP side streams keyed by id(group)
        ("dp_cp", "tp_dp_cp"),  # different dense roles
        ("cp", "tp_cp"),  # tp 1: tp_cp = cp, still two roles
        ("inter_dp_cp", "dp"),  # the inter-instance all-reduce runs on its own stream
    ],
)
def test_kinds_of_different_roles_are_kept_apart_under_safe_and_merged_by_1(a, b):
    assert not _same("safe", a, b)
    assert _same("build", a, b)  # 1 merges them: the cost docs/compat.md states
    assert policy.apart_reason(a, b)


@pytest.mark.parametrize("twin, main", [("dp_cp_ag", "dp_cp"), ("ep_dp_ag", "ep_dp")])
@pytest.mark.parametrize("mode", ["safe", "build", "process"])
def test_an_all_gather_twin_never_shares_with_its_main_group(mode, twin, main):
    assert not _same(mode, main, twin)
    assert not _same(mode, main, twin, ranks=(3,))  # not even at size 1
    if mode != "safe":
        assert _same(mode, "dp_cp_ag", "ep_dp_ag")  # 1 / process: twins among themselves


def test_the_twin_bug_under_1_is_what_the_key_used_to_miss():
    # the ordinary key of a twin equals its main group's: only the kind tells them apart
    main = sharing.sharing_key([0, 1], None, None, T30, kind="dp_cp")
    twin = sharing.sharing_key([0, 1], None, None, T30, kind="dp_cp_ag")
    assert main[:4] == twin[:4] and main != twin


def test_tp_ep_is_never_shared_under_safe():
    for other in ("ep", "tp_dp", "tp_dp_cp", "tp_ep_mp"):
        assert not _same("safe", "tp_ep_mp", other)
    assert not _same("safe", "tp_ep_mp", "ep", ranks=(5,))  # size 1 too


def test_size_one_groups_share_under_safe_unless_an_audited_use_sees_both():
    assert _same("safe", "cp", "ep", ranks=(5,))
    assert _same("safe", "pos_embd", "tp", ranks=(5,))
    assert not _same("safe", "cp", "ep", ranks=(5, 7))
    # tp = pp = ep = 1: ChainedOptimizer's == on the grad-statistics groups
    assert not _same("safe", "mp", "tp_ep_pp", ranks=(5,))
    # dp x cp = 1 with the distributed optimizer: mp against the optimizer instance group
    assert not _same("safe", "mp", "intra_dist_opt_instance", ranks=(5,))
    assert not _same("safe", "dp_cp", "ep_dp", ranks=(5,))  # Megatron-FSDP's pool registration
    assert not _same("safe", "gtp_remat", "expt_gtp_remat", ranks=(5,))  # GTP streams by id(group)
    assert _same("safe", "tp_ep_pp", "tp_ep_gtp_remat_pp", ranks=(5,))  # one side of the tie


def test_no_class_joins_two_sides_of_an_audited_tie():
    kinds = list(GROUP_KINDS)
    for tie in policy.AUDITED_TIES:
        assert set(tie.kinds) <= set(GROUP_KINDS) and tie.reason and tie.megatron
        for role in policy.ROLES:  # a role holds at most one side of each tie
            sides = {i for i, side in enumerate(tie.sides) for kind in side if kind in role.kinds}
            assert len(sides) <= 1, (tie.name, role.name)
    for a in kinds:
        for b in kinds:
            for size in (1, 4):
                rule = policy.merge_rule(a, b, size, None)
                if policy.tie_between(a, b) is not None:
                    assert rule is None, (a, b, size)
                    assert "audited use" in policy.apart_reason(a, b)


def test_a_merged_description_names_every_kind():
    assert policy.merged_desc("TENSOR_MODEL_PARALLEL_GROUP", "POSITION_EMBEDDING_GROUP") == (
        "TENSOR_MODEL_PARALLEL_GROUP+POSITION_EMBEDDING_GROUP"
    )
    assert policy.merged_desc("A+B", "B") == "A+B" and policy.merged_desc(None, "A") == "A"
    assert policy.kinds_of_desc("TENSOR_MODEL_PARALLEL_GROUP+POSITION_EMBEDDING_GROUP") == ("tp", "pos_embd")


def test_a_shared_group_is_described_by_all_its_kinds(fake_world):
    from parallel_state_ng.groups.factory import GroupFactory

    fake_world(5, 8)
    factory = GroupFactory(share="safe")
    tp, _ = factory.group([5], group_desc=_desc("tp"), timeout=T30)
    pos, new = factory.group([5], group_desc=_desc("pos_embd"), timeout=T30)
    assert pos is tp and not new
    assert tp.group_desc == "TENSOR_MODEL_PARALLEL_GROUP+POSITION_EMBEDDING_GROUP"
    factory.destroy([tp])


def test_gloo_twins_share_among_themselves_not_with_main_groups():
    pool = _pool("safe")
    dp_gloo, _ = pool.get([0, 2], backend="gloo", group_desc="DATA_PARALLEL_GROUP_GLOO", timeout=T30)
    dp_cp_gloo, _ = pool.get([0, 2], backend="gloo", group_desc="DATA_PARALLEL_GROUP_WITH_CP_GLOO", timeout=T30)
    ep_dp_gloo, _ = pool.get([0, 2], backend="gloo", group_desc="EXPERT_DATA_PARALLEL_GROUP_GLOO", timeout=T30)
    main, _ = pool.get([0, 2], group_desc="DATA_PARALLEL_GROUP", timeout=T30)
    assert dp_gloo is dp_cp_gloo is ep_dp_gloo and main is not dp_gloo


@pytest.mark.parametrize(
    "what, first, second",
    [
        ("backend", dict(backend=None), dict(backend="ucc")),
        ("timeout", dict(timeout=T30), dict(timeout=None)),
        ("high-priority stream", dict(pg_options="hp"), dict(pg_options="normal")),
    ],
)
def test_differing_options_are_kept_apart_under_safe(what, first, second):
    pool = _pool("safe")
    a, _ = pool.get([0, 2], group_desc=_desc("dp"), **{"timeout": T30, **first})
    b, _ = pool.get([0, 2], group_desc=_desc("dp_cp"), **{"timeout": T30, **second})
    assert a is not b, what


def test_sharp_eligibility_is_part_of_the_safe_key(monkeypatch):
    pool = _pool("safe")
    monkeypatch.setenv("NCCL_COLLNET_ENABLE", "1")  # as the plan sets it around dp_cp's creation
    dp_cp, _ = pool.get([0, 2], group_desc=_desc("dp_cp"), timeout=T30)
    monkeypatch.delenv("NCCL_COLLNET_ENABLE")
    dp, _ = pool.get([0, 2], group_desc=_desc("dp"), timeout=T30)
    assert dp is not dp_cp
    assert _same("build", "dp", "dp_cp")  # 1 ignores it (docs/compat.md)


def test_pipeline_coincidences_share_but_not_with_expert_or_tp():
    assert _same("safe", "pp", "embd") and _same("safe", "mp", "pp")
    assert not _same("safe", "mp", "intra_dist_opt_instance")  # the grad-statistics tie
    assert not _same("safe", "mp", "tp")  # pp 1: mp = tp, two roles
    assert not _same("safe", "mp", "tp_ep_pp")


def test_safe_does_not_span_layouts():
    create = _Recorder()
    one = sharing.GroupPool(share="safe", create=create)
    two = sharing.GroupPool(share="safe", create=create)
    a, _ = one.get([0, 1], group_desc=_desc("tp"), timeout=T30)
    b, _ = two.get([0, 1], group_desc=_desc("tp"), timeout=T30)
    assert a is not b and registry.entries() == []


# --------------------------------------------------------------------------- through compat
def _init(fake_world, monkeypatch, mode, rank=0, **kwargs):
    fake_world(rank, 8)
    monkeypatch.setattr(sharing, "_override", mode)
    ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
    return ps.get_state()


@pytest.mark.parametrize("rank", [0, 7])
def test_compat_under_safe_at_tp2_pp2_ep2(fake_world, monkeypatch, rank):
    state = _init(
        fake_world,
        monkeypatch,
        "safe",
        rank,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
    )
    try:
        dp, dp_cp = ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)
        ep, tp = ps.get_expert_model_parallel_group(), ps.get_tensor_model_parallel_group()
        assert dist.get_process_group_ranks(ep) == dist.get_process_group_ranks(dp_cp)  # they coincide
        assert dp is dp_cp and ep is not dp_cp  # one role shares, two roles do not
        assert ps.get_tensor_and_context_parallel_group() is tp
        assert ps.get_expert_tensor_parallel_group() is not tp
        assert ps.get_expert_tensor_and_model_parallel_group() is not ps.get_tensor_and_data_parallel_group()
        for group in state.created:  # WORLD is never handed out as a kind's group
            assert group is not dist.group.WORLD
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("mode", ["safe", "1", "process"])
def test_compat_all_gather_twins_are_their_own_groups(fake_world, monkeypatch, mode):
    facts = served_facts()
    skip_unless(facts.all_gather_group_in_init or facts.all_gather_groups_function, "no all-gather twins")
    extra = {"create_all_gather_group": True} if facts.all_gather_group_in_init else {}
    _init(fake_world, monkeypatch, mode, 3, tensor_model_parallel_size=2, expert_model_parallel_size=2, **extra)
    try:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        if facts.all_gather_groups_function:
            # the init's timeout, as megatron.training passes it: the ordinary key equals dp_cp's
            ag, expt_ag = ps.create_all_gather_groups(for_expert_parallelism=True, timeout=T30)
            assert expt_ag is not ps.get_expert_data_parallel_group()
        else:
            ag = ps.get_state().groups["dp_cp_ag"]
        assert dist.get_process_group_ranks(ag) == dist.get_process_group_ranks(dp_cp)
        assert ag is not dp_cp
    finally:
        ps.destroy_model_parallel()


# --------------------------------------------------------------------------- the layout tool
def test_layout_tool_reports_each_setting_and_why_pairs_are_kept_apart(capsys):
    argv = ["layout", "--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "2", "--share"]
    assert cli_main([*argv, "--all-gather-groups", "--release", "0.16", "--format", "json"]) == 0
    rank0 = json.loads(capsys.readouterr().out)["report"]["communicators"]["ranks"]["0"]
    assert rank0["without_sharing"] > rank0["safe"] > rank0["with_sharing"]
    merged_by_1 = [set(descs) for descs in rank0["shared"]]
    assert not any("DATA_PARALLEL_GROUP_WITH_CP_AG" in descs for descs in merged_by_1)  # the twin fix
    assert {"DATA_PARALLEL_GROUP_WITH_CP", "EXPERT_MODEL_PARALLEL_GROUP"} <= merged_by_1[0]
    apart = {pair["kinds"]: pair["reason"] for pair in rank0["kept_apart_by_safe"]}
    assert "expert kind and a dense one" in apart["DATA_PARALLEL_GROUP_WITH_CP / EXPERT_MODEL_PARALLEL_GROUP"]
    assert {"kinds": ["DATA_PARALLEL_GROUP_WITH_CP", "DATA_PARALLEL_GROUP"], "why": "role dp"} in rank0["shared_safe"]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "kept apart by safe on rank 0 (merged by 1):" in text and "(role pipeline)" in text


def test_docs_print_the_policy_table():
    page = (ROOT_DOCS / "compat.md").read_text(encoding="utf-8")
    start, end = "<!-- sharing-policy-table -->\n", "\n<!-- /sharing-policy-table -->"
    assert start in page and end in page
    printed = page.split(start, 1)[1].split(end, 1)[0]
    assert printed == policy.policy_table(), "regenerate with parallel_state_ng.layout.sharing_policy.policy_table()"


def test_every_audited_use_that_changes_a_decision_is_answered():
    """A use of the identity audit that changes a decision sees only kinds ``safe`` keeps apart,
    or kinds on one side of a tie (Megatron's own aliases: the use takes one of them).
    """
    from itertools import combinations

    from parallel_state_ng.layout import identity_audit as audit

    answered = {use_id for tie in policy.AUDITED_TIES for use_id in tie.audit}
    known = {use.id for use in audit.IDENTITY_USES}
    assert answered <= known, answered - known
    for use in audit.IDENTITY_USES:
        if not use.verdict.startswith(audit.CHANGES):
            continue
        for a, b in combinations(use.kinds, 2):
            for size in (1, 4):
                if policy.merge_rule(a, b, size, None) is not None:
                    same_side = any(a in side and b in side for tie in policy.AUDITED_TIES for side in tie.sides)
                    assert same_side and use.id in answered, (use.id, a, b, size)
