"""A self-contained SVG picture of one group kind over the ranks of a job (``layout --format svg``).

Ranks are cells labelled with their number, in node blocks; every group of the kind gets its own
fill colour, listed in a legend; NVLink domains, when given, are bands holding their nodes.
Each cell is a ``<rect>`` with ``data-rank``, ``data-node`` and
``data-group`` attributes (``data-group="none"``: in no group of the kind) and a ``<title>``
tooltip. The tool: docs/tools.md#layout-tool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from parallel_state_ng.tools.common import SVG_MARGIN as _MARGIN
from parallel_state_ng.tools.common import SVG_TITLE_H as _TITLE_H
from parallel_state_ng.tools.common import group_colour, svg_head, svg_legend_entry, text_colour

__all__ = ["render_svg", "MAX_SVG_RANKS"]

#: Largest world drawn; bigger worlds make pictures nobody can read (use text or JSON).
MAX_SVG_RANKS = 1024

_CELL_W, _CELL_H, _CELL_GAP = 38, 24, 2
_NODE_PAD, _NODE_HEAD, _NODE_GAP = 5, 16, 10
_MAX_WIDTH = 1240
_MAX_CELLS_PER_NODE_ROW = 16
_LEGEND_W, _LEGEND_H, _MAX_LEGEND = 250, 18, 64
_NO_GROUP_FILL = "#eeeeee"
_DOMAIN_HEAD, _DOMAIN_PAD = 18, 6
_DOMAIN_FILLS = ("#e8eef7", "#f3ecdf")


def _owners(world_size: int, groups: Sequence[Sequence[int]]) -> list[int]:
    """Index of the group holding each rank (-1: none)."""
    owner = [-1] * world_size
    for index, members in enumerate(groups):
        for rank in members:
            owner[rank] = index
    return owner


def _node_positions(
    num_nodes: int, nodes_per_domain: int | None, nodes_per_row: int, block_w: int, block_h: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]], int]:
    """Top-left corner of each node block, each domain's band ``(x, y, w, h)``, and the grid height.

    Without domains the nodes flow in rows; with domains each domain starts a new row inside
    its band (a header line, then its nodes).
    """
    if nodes_per_domain is None:
        rows = math.ceil(num_nodes / nodes_per_row)
        spots = [
            (_MARGIN + (n % nodes_per_row) * (block_w + _NODE_GAP), (n // nodes_per_row) * (block_h + _NODE_GAP))
            for n in range(num_nodes)
        ]
        return spots, [], rows * block_h + (rows - 1) * _NODE_GAP
    spots, bands, y = [], [], 0
    for first in range(0, num_nodes, nodes_per_domain):
        count = min(nodes_per_domain, num_nodes - first)
        rows = math.ceil(count / nodes_per_row)
        used = min(count, nodes_per_row)
        inner_h = rows * block_h + (rows - 1) * _NODE_GAP
        band_w = used * block_w + (used - 1) * _NODE_GAP + 2 * _DOMAIN_PAD
        bands.append((_MARGIN, y, band_w, _DOMAIN_HEAD + inner_h + 2 * _DOMAIN_PAD))
        for i in range(count):
            spots.append(
                (
                    _MARGIN + _DOMAIN_PAD + (i % nodes_per_row) * (block_w + _NODE_GAP),
                    y + _DOMAIN_HEAD + _DOMAIN_PAD + (i // nodes_per_row) * (block_h + _NODE_GAP),
                )
            )
        y += _DOMAIN_HEAD + inner_h + 2 * _DOMAIN_PAD + _NODE_GAP
    return spots, bands, y - _NODE_GAP


def render_svg(
    *,
    world_size: int,
    gpus_per_node: int,
    groups: Sequence[Sequence[int]],
    kind: str,
    title: str,
    group_labels: Sequence[str] | None = None,
    highlight_rank: int | None = None,
    ranks_per_domain: int | None = None,
) -> str:
    """The SVG document (a str) colouring the ``groups`` of ``kind`` over ``world_size`` ranks.

    ``group_labels`` (one per group) are the legend/tooltip texts of the groups (default: the
    full rank lists); ``highlight_rank`` gets a thick outline. ``ranks_per_domain``: NVLink
    domains (domain = rank // it) drawn as bands holding their nodes; cells of a group that
    crosses a domain get a dashed red outline and ``data-crossing="1"``. Raises ``ValueError``
    for a world larger than :data:`MAX_SVG_RANKS`, a ``gpus_per_node`` that does not divide it,
    or one that does not divide ``ranks_per_domain``.
    """
    if world_size > MAX_SVG_RANKS:
        raise ValueError(f"world_size {world_size} is larger than {MAX_SVG_RANKS}, the most an SVG picture shows")
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise ValueError(f"gpus_per_node {gpus_per_node} does not divide world_size {world_size}")
    if ranks_per_domain is not None and (ranks_per_domain < 1 or ranks_per_domain % gpus_per_node):
        raise ValueError(f"gpus_per_node {gpus_per_node} does not divide ranks_per_domain {ranks_per_domain}")
    labels = list(group_labels) if group_labels is not None else [str(list(g)) for g in groups]
    owner = _owners(world_size, groups)
    num_nodes = world_size // gpus_per_node
    nodes_per_domain = None if ranks_per_domain is None else ranks_per_domain // gpus_per_node
    crossing = (
        set()
        if ranks_per_domain is None
        else {i for i, g in enumerate(groups) if len({r // ranks_per_domain for r in g}) > 1}
    )

    cols = min(gpus_per_node, _MAX_CELLS_PER_NODE_ROW)
    rows = math.ceil(gpus_per_node / cols)
    block_w = 2 * _NODE_PAD + cols * _CELL_W + (cols - 1) * _CELL_GAP
    block_h = _NODE_HEAD + _NODE_PAD + rows * _CELL_H + (rows - 1) * _CELL_GAP
    room = _MAX_WIDTH - 2 * _MARGIN + _NODE_GAP - (0 if nodes_per_domain is None else 2 * _DOMAIN_PAD)
    nodes_per_row = max(1, min(num_nodes, room // (block_w + _NODE_GAP)))
    spots, bands, grid_h = _node_positions(num_nodes, nodes_per_domain, nodes_per_row, block_w, block_h)
    grid_w = max(x + block_w for x, _ in spots) - _MARGIN + (0 if not bands else _DOMAIN_PAD)

    content_w = max(grid_w, 2 * _LEGEND_W, 560)
    per_legend_row = max(1, content_w // _LEGEND_W)
    shown = min(len(groups), _MAX_LEGEND)
    legend_rows = math.ceil(shown / per_legend_row) + (1 if len(groups) > shown else 0) + 1
    legend_top = _MARGIN + _TITLE_H + grid_h + 16
    width = content_w + 2 * _MARGIN
    height = legend_top + legend_rows * _LEGEND_H + _MARGIN

    subtitle = (
        f"{len(groups)} {kind} groups, one colour each; {num_nodes} nodes of {gpus_per_node} GPUs "
        f"(node = rank // {gpus_per_node})"
    )
    if ranks_per_domain is not None:
        subtitle += (
            f"; {len(bands)} NVLink domains (domain = rank // {ranks_per_domain}), "
            f"{len(crossing)} {kind} groups cross one (dashed red)"
        )
    out = svg_head(width, height, title, subtitle)
    top = _MARGIN + _TITLE_H
    for domain, (x, y, w, h) in enumerate(bands):
        assert ranks_per_domain is not None
        last = min(world_size, (domain + 1) * ranks_per_domain) - 1
        out.append(
            f'<rect class="domain" x="{x}" y="{top + y}" width="{w}" height="{h}" rx="6" '
            f'fill="{_DOMAIN_FILLS[domain % 2]}" '
            f'stroke="#3b5b8a" stroke-width="1.5" data-domain="{domain}"/>'
        )
        out.append(
            f'<text x="{x + _DOMAIN_PAD}" y="{top + y + 13}" font-size="11" font-weight="bold" fill="#3b5b8a">'
            f"NVLink domain {domain}: ranks {domain * ranks_per_domain}..{last}</text>"
        )
    for node in range(num_nodes):
        bx, by = spots[node][0], top + spots[node][1]
        out.append(f'<g class="node" data-node-block="{node}">')
        out.append(
            f'<rect class="node-outline" x="{bx}" y="{by}" width="{block_w}" height="{block_h}" rx="4" '
            f'fill="#fafafa" stroke="#555555" stroke-width="1.2"/>'
        )
        out.append(f'<text x="{bx + _NODE_PAD}" y="{by + 12}" font-size="10" fill="#333333">node {node}</text>')
        for local in range(gpus_per_node):
            rank = node * gpus_per_node + local
            cx = bx + _NODE_PAD + (local % cols) * (_CELL_W + _CELL_GAP)
            cy = by + _NODE_HEAD + (local // cols) * (_CELL_H + _CELL_GAP)
            index = owner[rank]
            fill = group_colour(index) if index >= 0 else _NO_GROUP_FILL
            group_attr = str(index) if index >= 0 else "none"
            tip = f"rank {rank}, node {node}: " + (
                f"{kind} group {index} {labels[index]}" if index >= 0 else f"in no {kind} group"
            )
            if rank == highlight_rank:
                stroke = ' stroke="#000000" stroke-width="3"'
            elif index in crossing:
                stroke = ' stroke="#d62728" stroke-width="2" stroke-dasharray="3,2" data-crossing="1"'
                tip += " (crosses an NVLink domain)"
            else:
                stroke = ' stroke="#888888" stroke-width="0.6"'
            out.append(
                f'<rect x="{cx}" y="{cy}" width="{_CELL_W}" height="{_CELL_H}" rx="2" fill="{fill}"{stroke} '
                f'data-rank="{rank}" data-node="{node}" data-group="{group_attr}"><title>{escape(tip)}</title></rect>'
            )
            text_fill = text_colour(fill) if index >= 0 else "#999999"
            out.append(
                f'<text x="{cx + _CELL_W / 2:g}" y="{cy + _CELL_H / 2 + 4:g}" font-size="11" text-anchor="middle" '
                f'fill="{text_fill}" pointer-events="none">{rank}</text>'
            )
        out.append("</g>")

    out.append(f'<text x="{_MARGIN}" y="{legend_top}" font-size="12" font-weight="bold">{escape(kind)} groups</text>')
    for i in range(shown):
        lx = _MARGIN + (i % per_legend_row) * _LEGEND_W
        ly = legend_top + (i // per_legend_row + 1) * _LEGEND_H
        text = f"{i}: {labels[i]}"
        if len(text) > 38:
            text = text[:37] + "…"
        out += svg_legend_entry(lx, ly, i, f'data-legend-group="{i}"', text)
    if len(groups) > shown:
        ly = legend_top + (math.ceil(shown / per_legend_row) + 1) * _LEGEND_H
        out.append(
            f'<text x="{_MARGIN}" y="{ly}" font-size="10.5" fill="#444444">'
            f"… and {len(groups) - shown} more groups (hover a cell for its group)</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"
