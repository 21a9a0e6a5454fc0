"""Communicators per rank with and without group sharing (``layout --share``, ``--with-layout``).

Feeds the rank's group plan (:func:`parallel_state_ng.layout.plan.group_plan`) to a
:class:`~parallel_state_ng.groups.sharing.GroupPool` under
:func:`~parallel_state_ng.groups.sharing.record_requests` (nothing is created, no processes):
once as Megatron-Core does it (one communicator per group kind), once under the policy by role
(``PSNG_SHARE_GROUPS=safe``, :mod:`parallel_state_ng.layout.sharing_policy`) and once with
``PSNG_SHARE_GROUPS=1``, where kinds with identical rank lists and options share one; it names
the kinds each setting merges and why ``safe`` keeps apart what ``1`` merges. With
several layouts (``--with-layout``: e.g. a training and an inference layout in one process),
also with the process-wide registry (``PSNG_SHARE_GROUPS=process``), where the layouts share
one communicator per identical group. Counts are a pure function of the layouts' rank lists.
The tool: docs/tools.md#communicators-per-rank-and-group-sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from parallel_state_ng.groups.factory import GroupFactory
from parallel_state_ng.groups.sharing import PlannedGroup, record_requests
from parallel_state_ng.layout.kinds import GROUP_KINDS
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, PlanOptions, group_plan
from parallel_state_ng.layout.sharing_policy import apart_reason, kind_of_desc, role_of
from parallel_state_ng.tools.common import UsageError

__all__ = [
    "planned_groups",
    "communicator_report",
    "parse_layout_spec",
    "layouts_report",
    "render_communicators",
    "render_layouts",
]

#: ``--with-layout`` keys -> MegatronLayout arguments.
SPEC_KEYS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}


def _request_plan(layout: MegatronLayout, rank: int, gloo: bool, all_gather: bool) -> None:
    """Request every group of ``rank``'s plan from a new pool (one build).

    ``all_gather``: also the all-gather twins as ``megatron.training`` asks for them (the init
    timeout; the expert twin with ep > 1): in the build on 0.16-0.17
    (``create_all_gather_group=True``), from a pool of their own after it on 0.18+
    (``create_all_gather_groups()``).
    """
    init_timeout = timedelta(minutes=30)
    facts = layout.facts
    in_init = all_gather and facts.all_gather_group_in_init
    factory = GroupFactory()
    for step in group_plan(layout, rank, PlanOptions(create_gloo_process_groups=gloo, create_all_gather_group=in_init)):
        if isinstance(step, CreateGroup):
            factory.group(
                step.ranks,
                timeout=init_timeout if step.timeout == "init" else None,
                backend=step.backend,
                pg_options=None,
                group_desc=step.desc,
            )
    if all_gather and facts.all_gather_groups_function:
        kinds = ["dp_cp_ag"] + (["ep_dp_ag"] if layout.expert_model_parallel_size > 1 else [])
        for kind in kinds:
            members = layout.group(kind, rank)
            if members is not None:  # add_group: one pool per group made on request
                GroupFactory().group(members, timeout=init_timeout, group_desc=GROUP_KINDS[kind].desc)


def planned_groups(
    layout: MegatronLayout | Sequence[MegatronLayout],
    rank: int,
    *,
    gloo: bool,
    share: bool | str,
    all_gather: bool = False,
) -> list[PlannedGroup]:
    """The groups initialize_model_parallel (default options) would create on ``rank``.

    Several layouts: one build each, in order, in one process (``share="process"``: they share
    through the registry). ``all_gather``: with the all-gather twins (see :func:`_request_plan`).
    """
    layouts = [layout] if isinstance(layout, MegatronLayout) else list(layout)
    with record_requests(share=share) as planned:
        for one in layouts:
            if one.contains(rank):
                _request_plan(one, rank, gloo, all_gather)
    return list(planned)


def _why_shared(descs: list[str]) -> str:
    """Which ``safe`` class a merged group falls in, for the report."""
    kinds = [kind_of_desc(d) for d in descs]
    if all(d.endswith("_GLOO") or "_GLOO_" in d for d in descs):
        return "gloo twins"
    roles = {role_of(k) for k in kinds}
    return f"role {roles.pop()}" if len(roles) == 1 and None not in roles else "size 1"


def _kept_apart(one: list[list[str]], safe: list[list[str]]) -> list[dict[str, str]]:
    """For each group ``1`` merges, the pairs of ``safe``'s groups in it, with ``safe``'s reason."""
    where = {desc: i for i, descs in enumerate(safe) for desc in descs}
    out = []
    for descs in one:
        heads = list(dict.fromkeys(where.get(d, -1 - n) for n, d in enumerate(descs)))
        firsts = [next(d for n, d in enumerate(descs) if where.get(d, -1 - n) == h) for h in heads]
        for i, a in enumerate(firsts):
            for b in firsts[i + 1 :]:
                ka, kb = kind_of_desc(a) or a, kind_of_desc(b) or b
                out.append({"kinds": f"{a} / {b}", "reason": apart_reason(ka, kb)})
    return out


def communicator_report(
    layout: MegatronLayout, ranks: list[int], *, gloo: bool, all_gather: bool = False
) -> dict[str, Any]:
    """Per rank: communicators without sharing, under ``safe`` and under ``1``; what each merges."""
    out: dict[str, Any] = {"gloo_twins": gloo, "all_gather_twins": all_gather, "ranks": {}}
    for rank in dict.fromkeys(ranks):
        count = {
            mode: planned_groups(layout, rank, gloo=gloo, share=mode, all_gather=all_gather)
            for mode in ("off", "safe", "build")
        }
        merged = {mode: [g.descs for g in count[mode] if len(g.descs) > 1] for mode in ("safe", "build")}
        out["ranks"][str(rank)] = {
            "without_sharing": len(count["off"]),
            "safe": len(count["safe"]),
            "with_sharing": len(count["build"]),
            "shared_safe": [{"kinds": descs, "why": _why_shared(descs)} for descs in merged["safe"]],
            "shared": merged["build"],
            "kept_apart_by_safe": _kept_apart(merged["build"], [g.descs for g in count["safe"]]),
        }
    return out


def parse_layout_spec(text: str, world_size: int, release: str | None = None) -> MegatronLayout:
    """``"tp=8,pp=1"`` (keys tp, pp, cp, ep, etp; sizes >= 1) -> the layout over ``world_size`` ranks.

    Raises:
        UsageError: an unknown key, a repeated key, a size that is not an int >= 1, or sizes
            the world cannot be laid out with (naming ``--with-layout``).
    """
    kwargs: dict[str, Any] = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SPEC_KEYS:
            raise UsageError(
                f"bad part {part!r} of {text!r}: use key=size with keys {', '.join(SPEC_KEYS)}", "--with-layout"
            )
        if SPEC_KEYS[key] in kwargs:
            raise UsageError(f"{key} given twice in {text!r}", "--with-layout")
        if not value.strip().isdigit() or int(value) < 1:
            raise UsageError(f"{key} must be an int >= 1 in {text!r}, got {value.strip()!r}", "--with-layout")
        kwargs[SPEC_KEYS[key]] = int(value)
    if not kwargs:
        raise UsageError(f"empty layout {text!r}: give e.g. tp=8,pp=1", "--with-layout")
    try:
        return MegatronLayout(world_size=world_size, release=release, **kwargs)
    except (RuntimeError, AssertionError, KeyError, ValueError, TypeError) as err:
        raise UsageError(f"invalid layout {text!r} over {world_size} ranks: {err}", "--with-layout") from None


def _describe(layout: MegatronLayout) -> str:
    sizes = (
        f"tp={layout.tensor_model_parallel_size} pp={layout.pipeline_model_parallel_size} "
        f"cp={layout.context_parallel_size} ep={layout.expert_model_parallel_size} dp={layout.data_parallel_size}"
    )
    return sizes


def layouts_report(layouts: Sequence[MegatronLayout], ranks: list[int], *, gloo: bool) -> dict[str, Any]:
    """Per rank: communicators of all ``layouts`` built in one process, under each sharing setting.

    ``off``: one per group kind per layout (Megatron-Core); ``safe``: the policy by role within
    each layout; ``build``: identical groups shared within each layout (``PSNG_SHARE_GROUPS=1``);
    ``process``: identical groups shared across the layouts too (the registry,
    ``PSNG_SHARE_GROUPS=process``).
    """
    out: dict[str, Any] = {"gloo_twins": gloo, "layouts": [_describe(one) for one in layouts], "ranks": {}}
    for rank in dict.fromkeys(ranks):
        out["ranks"][str(rank)] = {
            mode: len(planned_groups(layouts, rank, gloo=gloo, share=mode))
            for mode in ("off", "safe", "build", "process")
        }
    return out


def render_communicators(info: dict[str, Any]) -> list[str]:
    """Text lines for :func:`communicator_report`'s data."""
    twins = "on" if info["gloo_twins"] else "off"
    extra = ", all-gather twins as megatron.training asks for them" if info.get("all_gather_twins") else ""
    lines = [
        "",
        f"Communicators per rank (initialize_model_parallel defaults, gloo twins {twins}{extra}; "
        "PSNG_SHARE_GROUPS unset / safe / 1):",
        f"  {'rank':>9}  {'without sharing':>15}  {'safe':>5}  {'1':>5}",
    ]
    for rank, entry in info["ranks"].items():
        lines.append(f"  {rank:>9}  {entry['without_sharing']:>15}  {entry['safe']:>5}  {entry['with_sharing']:>5}")
    for rank, entry in info["ranks"].items():
        if entry["shared_safe"]:
            lines.append(f"  one group under safe on rank {rank}:")
            lines += [f"    {' = '.join(g['kinds'])}  ({g['why']})" for g in entry["shared_safe"]]
        if entry["shared"]:
            lines.append(f"  one group under 1 on rank {rank}:")
            lines += [f"    {' = '.join(descs)}" for descs in entry["shared"]]
        if entry["kept_apart_by_safe"]:
            lines.append(f"  kept apart by safe on rank {rank} (merged by 1):")
            lines += [f"    {pair['kinds']}: {pair['reason']}" for pair in entry["kept_apart_by_safe"]]
    return lines


def render_layouts(info: dict[str, Any]) -> list[str]:
    """Text lines for :func:`layouts_report`'s data."""
    twins = "on" if info["gloo_twins"] else "off"
    lines = ["", f"Communicators per rank for {len(info['layouts'])} layouts in one process (gloo twins {twins}):"]
    lines += [f"  layout {i + 1}: {text}" for i, text in enumerate(info["layouts"])]
    lines.append(
        f"  {'rank':>9}  {'no sharing':>10}  {'safe':>5}  {'PSNG_SHARE_GROUPS=1':>19}  {'=process (registry)':>19}"
    )
    for rank, entry in info["ranks"].items():
        lines.append(
            f"  {rank:>9}  {entry['off']:>10}  {entry['safe']:>5}  {entry['build']:>19}  {entry['process']:>19}"
        )
    return lines
