"""``python -m parallel_state_ng layout``: the process groups of a Megatron-Core configuration.

From :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout` (pure math: no processes,
no GPUs): the sizes and dims, every group kind with its groups, ``--rank R``'s view (coordinates,
groups, pipeline neighbours), node locality with a WARNING when tensor-parallel groups cross
nodes; ``--share`` adds communicators per rank (:mod:`.communicators`). Formats ``text``, ``json``
(a snapshot, :mod:`parallel_state_ng.layout.snapshot`, with the report under ``"report"``) and
``svg`` (:mod:`.svg`); ``--check`` and ``--diff`` are in :mod:`.check`. Work is O(world size) per
kind. The tool: docs/tools.md#layout-tool.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any, cast

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.snapshot import dumps_snapshot, snapshot_of
from parallel_state_ng.tools.common import (
    UsageError,
    dims_text,
    format_ranks,
    int_list,
    kind_entry,
    kind_lines,
    kind_text,
    name_list,
    non_negative_int,
    positive_int,
    write_output,
)
from parallel_state_ng.tools.layout import big_world, check

__all__ = [
    "add_arguments",
    "run",
    "build_layout",
    "build_report",
    "json_report",
    "render_text",
    "node_locality",
    "rank_view",
    "rank_view_lines",
    "resolve_gpus_per_node",
    "DEFAULT_GPUS_PER_NODE",
    "TENSOR_PARALLEL_KINDS",
]

DEFAULT_GPUS_PER_NODE = 8
#: Kinds whose groups should stay inside one node (they carry the heaviest traffic).
TENSOR_PARALLEL_KINDS = ("tp", "ep_tp")

# MegatronLayout's argument names as they appear in its error messages -> CLI options.
_OPTION_OF_ARGUMENT = (
    ("expert_gtp_remat_size", "--expert-gtp-remat-size"),
    ("gtp_remat_size", "--gtp-remat-size"),
    ("hierarchical_context_parallel_sizes", "--hcp-sizes"),
    ("num_distributed_optimizer_instances", "--num-dist-opt-instances"),
    ("expert_tensor_parallel_size", "--etp"),
    ("expert_model_parallel_size", "--ep"),
    ("tensor_model_parallel_size", "--tp"),
    ("pipeline_model_parallel_size", "--pp"),
    ("context_parallel_size", "--cp"),
    ("world_size", "--world-size"),
)


# --------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``layout`` command's options to ``parser``."""
    sizes = parser.add_argument_group("parallel sizes (initialize_model_parallel's arguments)")
    sizes.add_argument(
        "--world-size", type=positive_int, default=None, help="number of ranks (required, but not by --check)"
    )
    sizes.add_argument("--tp", type=positive_int, default=1, help="tensor_model_parallel_size (default 1)")
    sizes.add_argument("--pp", type=positive_int, default=1, help="pipeline_model_parallel_size (default 1)")
    sizes.add_argument("--cp", type=positive_int, default=1, help="context_parallel_size (default 1)")
    sizes.add_argument("--ep", type=positive_int, default=1, help="expert_model_parallel_size (default 1)")
    sizes.add_argument("--etp", type=positive_int, default=None, help="expert_tensor_parallel_size (default: --tp)")
    sizes.add_argument("--order", default="tp-cp-ep-dp-pp", help="rank order, fastest first (default tp-cp-ep-dp-pp)")
    sizes.add_argument(
        "--num-dist-opt-instances",
        type=positive_int,
        default=1,
        help="num_distributed_optimizer_instances (default 1)",
    )
    sizes.add_argument(
        "--hcp-sizes",
        type=int_list,
        default=None,
        help="hierarchical_context_parallel_sizes, comma-separated (e.g. 2,2); product must be --cp",
    )
    sizes.add_argument(
        "--gtp-remat-size", type=positive_int, default=1, help="gtp_remat_size (megatron-core 0.19+; default 1)"
    )
    sizes.add_argument(
        "--expert-gtp-remat-size",
        type=positive_int,
        default=1,
        help="expert_gtp_remat_size (megatron-core 0.19+; default 1)",
    )
    sizes.add_argument(
        "--release",
        default=None,
        help="megatron-core release whose layout to show, e.g. 0.19 (default: the installed one, "
        "$PSNG_MEGATRON_VERSION, else the newest supported)",
    )
    view = parser.add_argument_group("report")
    view.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=None,
        help=f"GPUs per node for the locality report and the SVG (node = rank // N; default "
        f"{DEFAULT_GPUS_PER_NODE}, or the whole world as one node when {DEFAULT_GPUS_PER_NODE} does not divide it)",
    )
    view.add_argument("--rank", type=non_negative_int, default=None, help="also show this rank's view")
    view.add_argument("--kinds", type=name_list, default=None, help="comma-separated group kinds to show (default all)")
    view.add_argument("--full", action="store_true", help="text: print every group and every rank (no abbreviation)")
    view.add_argument("--format", choices=("text", "json", "svg"), default="text", help="output format (default text)")
    view.add_argument("--color-kind", default="tp", help="svg: the group kind to colour (default tp)")
    view.add_argument("--output", "-o", default=None, help="write to this file instead of stdout")
    view.add_argument(
        "--share",
        action="store_true",
        help="also count communicators per rank (rank 0, the last rank and --rank) with and without group sharing",
    )
    view.add_argument(
        "--no-gloo-twins", action="store_true", help="--share: count as with create_gloo_process_groups=False"
    )
    view.add_argument(
        "--all-gather-groups",
        action="store_true",
        help="--share: count the all-gather twins too (0.16+), as megatron.training's --create-all-gather-group asks",
    )
    view.add_argument(
        "--with-layout",
        action="append",
        default=None,
        metavar="SPEC",
        help="--share: one more layout built in the same process (e.g. tp=8,pp=1; keys tp pp cp ep etp; "
        "repeatable): count all layouts' communicators without sharing, with PSNG_SHARE_GROUPS=1 and =process",
    )
    check.add_arguments(parser)
    from parallel_state_ng.tools.layout import nvlink

    nvlink.add_domain_arguments(
        parser, "--suggest-order", "list the orders that keep --keep-inside kinds inside a domain, best first"
    )


# --------------------------------------------------------------------------- model
def _translate(message: str) -> str:
    """A MegatronLayout error message with argument names replaced by CLI options."""
    for argument, option in _OPTION_OF_ARGUMENT:
        message = re.sub(rf"\b{argument}\b", option, message)
    return re.sub(r"\border (?=')", "--order ", message)


def build_layout(args: argparse.Namespace) -> MegatronLayout:
    """The :class:`MegatronLayout` of the parsed options; invalid sizes raise :class:`UsageError`."""
    try:
        return MegatronLayout(
            world_size=args.world_size,
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            context_parallel_size=args.cp,
            expert_model_parallel_size=args.ep,
            expert_tensor_parallel_size=args.etp,
            order=args.order,
            num_distributed_optimizer_instances=args.num_dist_opt_instances,
            hierarchical_context_parallel_sizes=args.hcp_sizes,
            gtp_remat_size=getattr(args, "gtp_remat_size", 1),
            expert_gtp_remat_size=getattr(args, "expert_gtp_remat_size", 1),
            release=getattr(args, "release", None),
        )
    except (RuntimeError, AssertionError, KeyError, ValueError, TypeError) as err:
        text = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)
        raise UsageError(f"invalid layout: {_translate(text)}") from None


def resolve_gpus_per_node(world_size: int, requested: int | None) -> int:
    """The node size to use: ``requested`` (must divide the world) or the default."""
    if requested is None:
        return DEFAULT_GPUS_PER_NODE if world_size % DEFAULT_GPUS_PER_NODE == 0 else world_size
    if world_size % requested:
        raise UsageError(f"{requested} does not divide --world-size {world_size}", "--gpus-per-node")
    return requested


def _expert_dim_name(name: str) -> str:
    return {"tp": "etp", "dp": "edp", "gtp_remat": "egtp_remat"}.get(name, name)


def node_locality(groups: Sequence[Sequence[int]], gpus_per_node: int) -> dict[str, int]:
    """How many nodes the groups span (min/max) and how many groups cross node boundaries."""
    spans = [len({rank // gpus_per_node for rank in members}) for members in groups]
    return {
        "num_groups": len(groups),
        "min_nodes": min(spans, default=0),
        "max_nodes": max(spans, default=0),
        "crossing_groups": sum(1 for s in spans if s > 1),
    }


def rank_view(layout: MegatronLayout, rank: int, kinds: Sequence[str], gpus_per_node: int) -> dict[str, Any]:
    """``rank``'s coordinates, its group of each kind (with its position) and its pipeline neighbours."""
    groups: dict[str, dict[str, Any] | None] = {}
    for kind in kinds:
        members = layout.group(kind, rank)
        groups[kind] = None if members is None else {"position": members.index(rank), "ranks": members}
    pipeline = cast("list[int]", layout.group("pp", rank))  # a rank of the layout is in a pp group
    stage = pipeline.index(rank)
    return {
        "rank": rank,
        "node": rank // gpus_per_node,
        "dense_coord": layout.decoder.coord(rank),
        "expert_coord": {_expert_dim_name(k): v for k, v in layout.expert.coord(rank).items() if k != "cp"},
        "pipeline": {
            "stage": stage,
            "stages": len(pipeline),
            "first": pipeline[0],
            "last": pipeline[-1],
            "next": pipeline[(stage + 1) % len(pipeline)],
            "prev": pipeline[(stage - 1) % len(pipeline)],
        },
        "groups": groups,
    }


def rank_view_lines(view: dict[str, Any], full: bool, indent: str, position_width: int | None = None) -> list[str]:
    """Text of a :func:`rank_view` at ``indent``: coordinates, pipeline, then one line per kind.

    ``position_width``: the width of the "position P of N" column (default: the widest one).
    """
    pipe = view["pipeline"]
    lines = [
        f"{indent}dense coordinate:  {dims_text(view['dense_coord'])}",
        f"{indent}expert coordinate: {dims_text(view['expert_coord'])}",
        f"{indent}pipeline: stage {pipe['stage']} of {pipe['stages']}; first {pipe['first']}, last {pipe['last']}, "
        f"next {pipe['next']}, prev {pipe['prev']}",
    ]
    kind_w = max((len(k) for k in view["groups"]), default=4)
    positions = {
        kind: f"position {entry['position']} of {len(entry['ranks'])}"
        for kind, entry in view["groups"].items()
        if entry is not None
    }
    if position_width is None:
        position_width = max((len(p) for p in positions.values()), default=0)
    for kind, entry in view["groups"].items():
        if entry is None:
            lines.append(f"{indent}{kind:<{kind_w}}  not a member of any {kind} group")
        else:
            ranks = format_ranks(entry["ranks"], full)
            lines.append(f"{indent}{kind:<{kind_w}}  {positions[kind]:<{position_width}}  {ranks}")
    return lines


def _warnings(layout: MegatronLayout, locality: dict[str, dict[str, int]], gpus_per_node: int) -> list[str]:
    out = []
    for kind in TENSOR_PARALLEL_KINDS:
        loc = locality[kind]
        if loc["crossing_groups"]:
            label = "tensor-parallel" if kind == "tp" else "expert tensor-parallel"
            size = layout.tensor_model_parallel_size if kind == "tp" else layout.expert_tensor_parallel_size
            out.append(
                f"WARNING: {label} groups ({kind}, size {size}) cross node boundaries: "
                f"{loc['crossing_groups']} of {loc['num_groups']} groups span up to {loc['max_nodes']} nodes "
                f"({gpus_per_node} GPUs per node). Keep them inside a node: size <= GPUs per node, "
                f"dividing it, and 'tp' first in --order."
            )
    return out


def build_report(
    layout: MegatronLayout,
    *,
    gpus_per_node: int,
    kinds: Sequence[str] | None = None,
    rank: int | None = None,
) -> dict[str, Any]:
    """The whole report as JSON-ready data (``kinds=None``: every kind of the layout)."""
    all_kinds = layout.kinds()
    shown = list(all_kinds if kinds is None else kinds)
    enumerated = {kind: layout.enumerate(kind) for kind in dict.fromkeys([*shown, *TENSOR_PARALLEL_KINDS])}
    locality = {kind: node_locality(groups, gpus_per_node) for kind, groups in enumerated.items()}
    kinds_out = {kind: kind_entry(kind, enumerated[kind]) for kind in shown}
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
            "num_distributed_optimizer_instances": layout.num_distributed_optimizer_instances,
            "release": layout.release,
            "gtp_remat_size": layout.gtp_remat_size,
            "expert_gtp_remat_size": layout.expert_gtp_remat_size,
            "hierarchical_context_parallel_sizes": (
                list(layout.hierarchical_context_parallel_sizes or ()) if layout.hierarchical_levels else None
            ),
            "dense_dims": dict(zip(layout.decoder.dim_names, layout.decoder.shape, strict=True)),
            # the expert layout has no context parallelism (its cp dim is always 1)
            "expert_dims": {
                _expert_dim_name(n): s
                for n, s in zip(layout.expert.dim_names, layout.expert.shape, strict=True)
                if n != "cp"
            },
            "gpus_per_node": gpus_per_node,
            "num_nodes": layout.world_size // gpus_per_node,
        },
        "kinds": kinds_out,
        "locality": {kind: locality[kind] for kind in shown},
        "warnings": _warnings(layout, locality, gpus_per_node),
        "rank": None if rank is None else rank_view(layout, rank, shown, gpus_per_node),
    }


def json_report(layout: MegatronLayout, report: dict[str, Any]) -> str:
    """``--format json``: the layout's snapshot (every kind), then the report under ``"report"``.

    The snapshot part (:mod:`parallel_state_ng.layout.snapshot`) is what ``--check`` and
    ``--diff`` read; ``report`` (sizes, dims, locality, warnings, the rank view, the selected
    kinds' descriptions and counts) depends on the report options and is not checked.
    """
    extra = {**report, "kinds": {k: {n: v for n, v in e.items() if n != "groups"} for k, e in report["kinds"].items()}}
    return dumps_snapshot(snapshot_of(layout), {"report": extra})


# --------------------------------------------------------------------------- text
def _span_text(loc: dict[str, int]) -> str:
    return str(loc["min_nodes"]) if loc["min_nodes"] == loc["max_nodes"] else f"{loc['min_nodes']}-{loc['max_nodes']}"


def render_text(report: dict[str, Any], full: bool = False) -> str:
    """The report for people (long lists abbreviated unless ``full``)."""
    cfg = report["config"]
    lines = [
        f"Megatron-Core process groups for world size {cfg['world_size']} (pure layout math: no processes, no GPUs)",
        f"sizes: tp={cfg['tp']} pp={cfg['pp']} cp={cfg['cp']} dp={cfg['dp']} ep={cfg['ep']} "
        f"etp={cfg['etp']} edp={cfg['edp']} order={cfg['order']}",
        f"dense layout (fastest first):  {dims_text(cfg['dense_dims'])}",
        f"expert layout (fastest first): {dims_text(cfg['expert_dims'])}",
        f"distributed-optimizer instances: {cfg['num_distributed_optimizer_instances']}"
        + (
            f"; hierarchical cp sizes: {cfg['hierarchical_context_parallel_sizes']}"
            if cfg["hierarchical_context_parallel_sizes"]
            else ""
        ),
        f"nodes: {cfg['num_nodes']} x {cfg['gpus_per_node']} GPUs (node = rank // {cfg['gpus_per_node']})",
        "",
    ]
    kinds = report["kinds"]
    note = "" if full else "; long lists abbreviated, --full prints all"
    lines.append(f"Groups ({len(kinds)} kinds{note}):")
    for kind, info in kinds.items():
        lines += kind_lines(kind, info, full)

    view = report["rank"]
    if view is not None:
        lines += ["", f"Rank {view['rank']} (node {view['node']}):", *rank_view_lines(view, full, "  ")]

    locality = report["locality"]
    if locality:
        lines += ["", f"Node locality ({cfg['gpus_per_node']} GPUs per node, {cfg['num_nodes']} nodes):"]
        kind_w = max(max(len(k) for k in locality), 4)
        lines.append(f"  {'kind':<{kind_w}}  {'groups':>7}  {'nodes per group':>15}  groups crossing nodes")
        for kind, loc in locality.items():
            lines.append(
                f"  {kind:<{kind_w}}  {loc['num_groups']:>7}  {_span_text(loc):>15}  "
                f"{loc['crossing_groups']} of {loc['num_groups']}"
            )
    if report.get("communicators"):
        from parallel_state_ng.tools.layout.communicators import render_communicators

        lines += render_communicators(report["communicators"])
    if report.get("layouts"):
        from parallel_state_ng.tools.layout.communicators import render_layouts

        lines += render_layouts(report["layouts"])
    lines.append("")
    if report["warnings"]:
        lines += report["warnings"]
    else:
        lines.append(f"tensor-parallel groups ({', '.join(TENSOR_PARALLEL_KINDS)}) stay inside nodes.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command
def run(args: argparse.Namespace, stdout: Any) -> int:
    """Run the ``layout`` command for parsed ``args``; returns the exit code."""
    if check.wanted(args):
        return check.run(args, stdout, build_layout)
    if args.world_size is None:
        raise UsageError("the following arguments are required: --world-size")
    from parallel_state_ng.tools.layout import nvlink

    layout = build_layout(args)
    domains = nvlink.domains_from_args(args, "--suggest-order", args.suggest_order)
    keep_inside = nvlink.keep_inside_from_args(args)
    gpus_per_node = resolve_gpus_per_node(args.world_size, args.gpus_per_node)
    if domains is not None:
        tray = nvlink.node_size_for_domains(domains, args.world_size, args.gpus_per_node)
        gpus_per_node = resolve_gpus_per_node(args.world_size, tray)
    known = layout.kinds()
    if args.kinds is not None:
        unknown = [k for k in args.kinds if k not in known]
        if unknown:
            raise UsageError(f"unknown group kind(s) {unknown}; kinds of this layout: {','.join(known)}", "--kinds")
    if args.rank is not None and args.rank >= args.world_size:
        raise UsageError(f"rank {args.rank} is out of range for --world-size {args.world_size}", "--rank")
    if big_world.too_large(args.world_size):
        text = big_world.layout_rank_only(args, layout, domains is not None, (rank_view, rank_view_lines))
        write_output(text, args.output, stdout)
        return 0

    if args.format == "svg":
        from parallel_state_ng.tools.layout.svg import MAX_SVG_RANKS, render_svg

        if args.color_kind not in known:
            raise UsageError(
                f"unknown group kind {args.color_kind!r}; kinds of this layout: {','.join(known)}", "--color-kind"
            )
        if args.world_size > MAX_SVG_RANKS:
            raise UsageError(
                f"{args.world_size} ranks are too many for --format svg (at most {MAX_SVG_RANKS}); "
                "use --format text or json",
                "--world-size",
            )
        groups = layout.enumerate(args.color_kind)
        cfg = (
            f"world {layout.world_size}: tp={layout.tensor_model_parallel_size} "
            f"pp={layout.pipeline_model_parallel_size} "
            f"cp={layout.context_parallel_size} dp={layout.data_parallel_size} ep={layout.expert_model_parallel_size} "
            f"etp={layout.expert_tensor_parallel_size}, order {layout.order}"
        )
        text = render_svg(
            world_size=layout.world_size,
            gpus_per_node=gpus_per_node,
            groups=groups,
            kind=args.color_kind,
            title=f"{args.color_kind} groups ({kind_text(args.color_kind)[1]}) - {cfg}",
            group_labels=[format_ranks(g) for g in groups],
            highlight_rank=args.rank,
            ranks_per_domain=None if domains is None else domains.ranks_per_domain,
        )
    else:
        report = build_report(layout, gpus_per_node=gpus_per_node, kinds=args.kinds, rank=args.rank)
        if args.share:
            from parallel_state_ng.tools.layout.communicators import communicator_report

            ranks = [0, args.world_size - 1] + ([] if args.rank is None else [args.rank])
            report["communicators"] = communicator_report(
                layout, ranks, gloo=not args.no_gloo_twins, all_gather=args.all_gather_groups
            )
            if args.with_layout:
                from parallel_state_ng.tools.layout.communicators import layouts_report, parse_layout_spec

                release = getattr(args, "release", None)
                more = [parse_layout_spec(text, args.world_size, release) for text in args.with_layout]
                report["layouts"] = layouts_report([layout, *more], ranks, gloo=not args.no_gloo_twins)
        elif args.with_layout:
            raise UsageError("--with-layout counts communicators: give --share too", "--with-layout")
        if domains is not None:
            report["nvlink"] = nvlink.nvlink_section(
                layout,
                domains,
                keep_inside,
                kinds=args.kinds,
                suggest=args.suggest_order,
                top=args.top,
                node_size=gpus_per_node,
            )
        text = json_report(layout, report) if args.format == "json" else render_text(report, full=args.full)
        if domains is not None and args.format == "text":
            text += nvlink.render_nvlink(report["nvlink"])
    write_output(text, args.output, stdout)
    return 0
