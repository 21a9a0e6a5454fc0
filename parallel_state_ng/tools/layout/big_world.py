"""Worlds too large to enumerate: one rank's view in closed form, or a refusal naming the limit.

A report that lists every group (``layout``, ``topology``, ``--diff`` of configurations) costs
O(world size) per kind; past :data:`~parallel_state_ng.layout.bounded_input.MAX_ENUMERATED_RANKS`
ranks the tools answer ``--rank R``'s view only (coordinates, pipeline, its group of each kind
whose groups fit the limit: O(group size) each, no group enumerated) and refuse the rest with
exit code 2. The limits: docs/reliability.md ("Hostile input").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from parallel_state_ng.layout.bounded_input import MAX_ENUMERATED_RANKS
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.tools.common import UsageError

__all__ = [
    "group_size_bound",
    "fitting_kinds",
    "too_large",
    "refuse_enumeration",
    "rank_only_report",
    "render_rank_only",
    "layout_rank_only",
    "topology_rank_only",
]


def too_large(world_size: int) -> bool:
    """Whether a world is past the limit of ranks a report enumerates."""
    return world_size > MAX_ENUMERATED_RANKS


def refuse_enumeration(world_size: int, option: str, what: str = "a report") -> UsageError:
    """The error for a world past the limit when no ``--rank`` narrows the answer."""
    return UsageError(
        f"{world_size} ranks is over the limit of {MAX_ENUMERATED_RANKS} ranks that {what} enumerates group by "
        f"group; give --rank R for one rank's view (closed form, any world size up to 2**62)",
        option,
    )


def group_size_bound(layout: MegatronLayout, kind: str) -> int:
    """An upper bound of the size of a group of ``kind`` in ``layout``, in closed form (no group built)."""
    dims = layout._kind_dims.get(kind)  # noqa: SLF001 - the layout's own table of token kinds
    if dims is not None and layout.encoder_block is None:
        lay, names = dims
        return lay.group_size(names)
    dp_cp = layout.data_parallel_size * layout.context_parallel_size
    stages = layout.pipeline_model_parallel_size + (layout.encoder_pipeline_model_parallel_size or 0)
    bounds = {
        "intra_dp_cp": dp_cp,
        "inter_dp_cp": dp_cp,
        "intra_ep_dp": layout.expert_data_parallel_size,
        "inter_ep_dp": layout.expert_data_parallel_size,
        "embd": stages,
        "pos_embd": stages,
    }
    if kind.startswith("hcp"):
        return layout.context_parallel_size
    return bounds.get(kind, layout.layout_world_size)


def fitting_kinds(
    layout: MegatronLayout, kinds: Sequence[str], explicit: bool, what: str
) -> tuple[list[str], dict[str, int]]:
    """``kinds`` whose groups fit the limit, and the others with their size bound.

    Raises:
        UsageError: a kind given with ``--kinds`` (``explicit``) or the pipeline (the view needs
            it) has groups larger than the limit.
    """
    over = {kind: group_size_bound(layout, kind) for kind in kinds}
    over = {kind: size for kind, size in over.items() if size > MAX_ENUMERATED_RANKS}
    if explicit and over:
        raise UsageError(
            f"{what}: the groups of {sorted(over)} have up to {max(over.values())} ranks, over the limit of "
            f"{MAX_ENUMERATED_RANKS} ranks listed; leave them out",
            "--kinds",
        )
    pipeline = group_size_bound(layout, "pp")
    if pipeline > MAX_ENUMERATED_RANKS:
        raise UsageError(
            f"{what}: pipelines of {pipeline} stages are over the limit of {MAX_ENUMERATED_RANKS} ranks listed",
            "--rank",
        )
    return [k for k in kinds if k not in over], over


def rank_only_report(
    layout: MegatronLayout, rank: int, kinds: Sequence[str] | None, rank_view: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """``layout``'s sizes and ``rank``'s view (closed form, ``rank_view``) for a world past the enumeration limit."""
    shown, omitted = fitting_kinds(layout, list(kinds or layout.kinds()), kinds is not None, "--rank view")
    view = rank_view(layout, rank, shown, gpus_per_node=1)
    del view["node"]
    return {
        "config": {
            "world_size": layout.world_size,
            "tp": layout.tensor_model_parallel_size,
            "pp": layout.pipeline_model_parallel_size,
            "cp": layout.context_parallel_size,
            "dp": layout.data_parallel_size,
            "ep": layout.expert_model_parallel_size,
            "etp": layout.expert_tensor_parallel_size,
            "edp": layout.expert_data_parallel_size,
            "order": layout.order,
            "release": layout.release,
        },
        "enumeration_limit": MAX_ENUMERATED_RANKS,
        "rank": view,
        "omitted_kinds": omitted,
    }


def render_rank_only(report: dict[str, Any], fmt: str, full: bool, rank_view_lines: Callable[..., list[str]]) -> str:
    """Text or JSON of a :func:`rank_only_report` (``rank_view_lines``: the view's text)."""
    if fmt == "json":
        return json.dumps(report) + "\n"

    cfg = report["config"]
    lines = [
        f"Megatron-Core process groups for world size {cfg['world_size']}: rank {report['rank']['rank']}'s view only "
        f"(over the limit of {report['enumeration_limit']} ranks that are enumerated group by group)",
        " ".join(f"{k}={v}" for k, v in cfg.items() if k != "world_size"),
        "",
        f"Rank {report['rank']['rank']}:",
        *rank_view_lines(report["rank"], full, "  "),
    ]
    for kind, size in report["omitted_kinds"].items():
        lines.append(f"  {kind}: groups of up to {size} ranks, over the limit: not listed")
    return "\n".join(lines) + "\n"


def layout_rank_only(args: Any, layout: MegatronLayout, nvlink: bool, views: tuple[Callable, Callable]) -> str:
    """The ``layout`` command's answer past the limit: ``--rank``'s view, or a :class:`UsageError`.

    ``views``: the report's ``(rank_view, rank_view_lines)``.
    """
    if args.format == "svg" or args.share or nvlink:
        given = "--format svg" if args.format == "svg" else "--share" if args.share else "the NVLink-domain options"
        raise UsageError(
            f"{given} needs every group of the {args.world_size} ranks, over the limit of {MAX_ENUMERATED_RANKS}; "
            "give --rank R alone for one rank's view",
            "--world-size",
        )
    if args.rank is None:
        raise refuse_enumeration(args.world_size, "--world-size")
    report = rank_only_report(layout, args.rank, args.kinds, views[0])
    return render_rank_only(report, args.format, args.full, views[1])


def topology_rank_only(
    args: Any, placements: Sequence[Any], own_kinds: Any, nvlink: bool, view_fns: tuple[Callable, Callable]
) -> str:
    """The ``topology`` command's answer past the limit: ``--rank``'s modules and groups, or a :class:`UsageError`.

    ``own_kinds``: placement -> the kinds its module builds; ``view_fns``: ``(rank_view, rank_view_lines)``.
    """
    rank_view, rank_view_lines = view_fns

    world_size = placements[0].layout.world_size
    if args.format == "svg" or nvlink:
        given = "--format svg" if args.format == "svg" else "the NVLink-domain options"
        raise UsageError(
            f"{given} needs every group of the {world_size} ranks, over the limit of {MAX_ENUMERATED_RANKS}; "
            "give --rank R alone for one rank's view",
            "SPEC",
        )
    if args.rank is None:
        raise refuse_enumeration(world_size, "SPEC", "a topology report")
    views, omitted = {}, {}
    for p in placements:
        if args.rank not in p.ranks:
            continue
        own = own_kinds(p)
        wanted = own if args.kinds is None else [k for k in args.kinds if k in own]
        shown, omitted[p.name] = fitting_kinds(p.layout, wanted, args.kinds is not None, f"module {p.name!r}")
        view = rank_view(p.layout, args.rank, shown, gpus_per_node=1)
        del view["node"], view["rank"]
        views[p.name] = view
    report = {
        "world_size": world_size,
        "enumeration_limit": MAX_ENUMERATED_RANKS,
        "rank": {"rank": args.rank, "modules": list(views), "views": views},
        "omitted_kinds": omitted,
    }
    if args.format == "json":
        return json.dumps(report) + "\n"
    lines = [
        f"Topology of {world_size} ranks: rank {args.rank}'s modules only (over the limit of "
        f"{MAX_ENUMERATED_RANKS} ranks that are enumerated group by group)",
        f"Rank {args.rank} runs {len(views)} module(s): {', '.join(views)}",
    ]
    for name, view in views.items():
        lines += [f"  {name}:", *rank_view_lines(view, args.full, "    ", position_width=18)]
        for kind, size in omitted[name].items():
            lines.append(f"    {kind}: groups of up to {size} ranks, over the limit: not listed")
    return "\n".join(lines) + "\n"
