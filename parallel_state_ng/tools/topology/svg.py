"""A self-contained SVG picture of a multi-module topology (``topology --format svg``).

Each rank range is a column, as wide as its share of the world, with its colocated modules
stacked in lanes; a rank axis below, a legend listing every module in full. Every block is a
``<g class="module">`` with ``data-module``, ``data-start``, ``data-stop`` (stop excluded),
``data-lane`` and ``data-language`` attributes, holding a ``<rect class="module-block">`` and a
``<title>`` tooltip; NVLink domains, when given, start at dashed ``<line class="domain-start">``
lines. The tool: docs/tools.md#topology-tool.
"""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from parallel_state_ng.layout.topology_spec import ModulePlacement
from parallel_state_ng.tools.common import SVG_MARGIN as _MARGIN
from parallel_state_ng.tools.common import SVG_TITLE_H as _TITLE_H
from parallel_state_ng.tools.common import group_colour, svg_head, svg_legend_entry, text_colour

__all__ = ["render_topology_svg"]

_AXIS_W, _MIN_COLUMN_W, _COLUMN_GAP = 960, 128, 4
_BLOCK_H, _LANE_GAP = 78, 6
_AXIS_H, _LEGEND_H = 50, 18
_CHAR_W = 6.4  # average glyph width at font-size 11 (DejaVu Sans), to shorten labels that do not fit


def _sizes_text(p: ModulePlacement) -> tuple[str, str]:
    lay = p.layout
    dense = (
        f"tp={lay.tensor_model_parallel_size} cp={lay.context_parallel_size} "
        f"dp={lay.data_parallel_size} pp={lay.pipeline_model_parallel_size}"
    )
    return dense, f"ep={lay.expert_model_parallel_size} etp={lay.expert_tensor_parallel_size}"


def _fit(text: str, width: float, char_w: float = _CHAR_W) -> str:
    most = max(1, int((width - 10) / char_w))
    return text if len(text) <= most else text[: most - 1] + "…"


def render_topology_svg(
    placements: Sequence[ModulePlacement], highlight_rank: int | None = None, ranks_per_domain: int | None = None
) -> str:
    """The SVG document (a str) of validated ``placements`` (from ``validate_topology``).

    ``highlight_rank`` gets a marker line through the blocks of the modules it runs;
    ``ranks_per_domain`` draws each NVLink domain's start (domain = rank // it) as a dashed line.
    """
    world = placements[0].layout.world_size
    release = placements[0].layout.release
    spans: dict[range, list[ModulePlacement]] = {}
    for p in placements:
        spans.setdefault(p.ranks, []).append(p)
    columns = sorted(spans, key=lambda r: r.start)
    widths = [max(_MIN_COLUMN_W, round(len(r) / world * _AXIS_W)) for r in columns]
    lefts = [_MARGIN + sum(widths[:i]) for i in range(len(columns))]
    lanes = max(len(v) for v in spans.values())
    axis_w = sum(widths)
    width = max(axis_w, 560) + 2 * _MARGIN
    top = _MARGIN + _TITLE_H
    axis_y = top + lanes * (_BLOCK_H + _LANE_GAP) + 4
    legend_top = axis_y + _AXIS_H
    height = legend_top + (len(placements) + 1) * _LEGEND_H + _MARGIN
    index = {p.name: i for i, p in enumerate(placements)}
    language = next(p.name for p in placements if p.spec.language)

    title = f"Topology: {world} ranks, {len(placements)} modules (megatron-core {release})"
    subtitle = (
        f"modules as blocks along the rank axis (column width ~ share of ranks); colocated modules stacked; "
        f"language module: {language}"
    )
    out = svg_head(width, height, title, _fit(subtitle, width - 2 * _MARGIN, 5.9))
    for ranks, x, w in zip(columns, lefts, widths, strict=True):
        for lane, p in enumerate(spans[ranks]):
            out += _block(p, lane, index[p.name], x + _COLUMN_GAP / 2, top + lane * (_BLOCK_H + _LANE_GAP), w)
    out += _axis(columns, lefts, widths, axis_y)
    if ranks_per_domain is not None:
        out += _domains(ranks_per_domain, world, columns, lefts, widths, top, axis_y)
    if highlight_rank is not None:
        out += _marker(highlight_rank, columns, lefts, widths, spans, top, axis_y)
    out.append(f'<text x="{_MARGIN}" y="{legend_top}" font-size="12" font-weight="bold">modules</text>')
    for i, p in enumerate(placements):
        ly = legend_top + (i + 1) * _LEGEND_H
        dense, expert = _sizes_text(p)
        text = (
            f"{p.name}: ranks {p.ranks.start}..{p.ranks.stop - 1} ({len(p.ranks)}), {dense} {expert}, "
            f"order {p.layout.order}"
            + (", language module" if p.spec.language else "")
            + (f", colocated with {', '.join(p.colocated_with)}" if p.colocated_with else "")
        )
        out += svg_legend_entry(_MARGIN, ly, i, f"data-legend-module={quoteattr(p.name)}", text)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _block(p: ModulePlacement, lane: int, i: int, x: float, y: float, column_w: int) -> list[str]:
    w = column_w - _COLUMN_GAP
    fill = group_colour(i)
    ink = text_colour(fill)
    dense, expert = _sizes_text(p)
    span = f"ranks {p.ranks.start}..{p.ranks.stop - 1} ({len(p.ranks)})"
    tip = f"module {p.name}: {span}; {dense} {expert}; order {p.layout.order}" + (
        "; language module" if p.spec.language else ""
    )
    lines = [
        (13, "bold", p.name),
        (11, "normal", span),
        (11, "normal", dense),
        (11, "normal", expert + (" · language" if p.spec.language else "")),
    ]
    out = [
        f'<g class="module" data-module={quoteattr(p.name)} data-start="{p.ranks.start}" '
        f'data-stop="{p.ranks.stop}" data-lane="{lane}" data-language="{str(p.spec.language).lower()}">',
        f"<title>{escape(tip)}</title>",
        f'<rect class="module-block" x="{x:g}" y="{y}" width="{w}" height="{_BLOCK_H}" rx="5" fill="{fill}" '
        f'stroke="#333333" stroke-width="{2 if p.spec.language else 1}"/>',
    ]
    ty = y + 17
    for size, weight, text in lines:
        out.append(
            f'<text x="{x + 6:g}" y="{ty}" font-size="{size}" font-weight="{weight}" fill="{ink}">'
            f"{escape(_fit(text, w, _CHAR_W * size / 11))}</text>"
        )
        ty += 18 if size > 11 else 16
    out.append("</g>")
    return out


def _axis(columns: list[range], lefts: list[int], widths: list[int], y: int) -> list[str]:
    end = lefts[-1] + widths[-1]
    out = [f'<line x1="{_MARGIN}" y1="{y}" x2="{end}" y2="{y}" stroke="#333333" stroke-width="1"/>']
    for ranks, x, w in zip(columns, lefts, widths, strict=True):
        per_rank = w / len(ranks)
        if per_rank >= 6:  # room for one tick per rank
            out += [
                f'<line x1="{x + (k + 0.5) * per_rank:g}" y1="{y}" x2="{x + (k + 0.5) * per_rank:g}" y2="{y + 4}" '
                f'stroke="#777777" stroke-width="0.6"/>'
                for k in range(len(ranks))
            ]
        out.append(f'<line x1="{x}" y1="{y - 4}" x2="{x}" y2="{y + 9}" stroke="#333333" stroke-width="1"/>')
        out.append(f'<text x="{x + 3}" y="{y + 20}" font-size="10" fill="#333333">rank {ranks.start}</text>')
        if len(ranks) > 1:
            out.append(
                f'<text x="{x + w - 3}" y="{y + 20}" font-size="10" fill="#333333" text-anchor="end">'
                f"{ranks.stop - 1}</text>"
            )
    out.append(f'<line x1="{end}" y1="{y - 4}" x2="{end}" y2="{y + 9}" stroke="#333333" stroke-width="1"/>')
    return out


def _domains(
    per: int, world: int, columns: list[range], lefts: list[int], widths: list[int], top: int, axis_y: int
) -> list[str]:
    """A dashed line and a label at the first rank of every NVLink domain."""
    out = []
    for domain, first in enumerate(range(0, world, per)):
        col = next(i for i, r in enumerate(columns) if first in r)
        x = lefts[col] + (first - columns[col].start) * widths[col] / len(columns[col])
        out += [
            f'<line class="domain-start" data-domain="{domain}" x1="{x:g}" y1="{top - 6}" x2="{x:g}" '
            f'y2="{axis_y + 36}" '
            f'stroke="#3b5b8a" stroke-width="1.5" stroke-dasharray="5,3"/>',
            f'<text x="{x + 3:g}" y="{axis_y + 34}" font-size="10" fill="#3b5b8a">NVLink domain {domain}</text>',
        ]
    return out


def _marker(
    rank: int,
    columns: list[range],
    lefts: list[int],
    widths: list[int],
    spans: dict[range, list[ModulePlacement]],
    top: int,
    axis_y: int,
) -> list[str]:
    col = next(i for i, r in enumerate(columns) if rank in r)
    ranks = columns[col]
    x = lefts[col] + (rank - ranks.start + 0.5) * widths[col] / len(ranks)
    names = ", ".join(p.name for p in spans[ranks])
    bottom = top + len(spans[ranks]) * (_BLOCK_H + _LANE_GAP)
    return [
        f'<line class="rank-marker" data-rank="{rank}" x1="{x:g}" y1="{top - 4}" x2="{x:g}" y2="{bottom}" '
        f'stroke="#d00000" stroke-width="2"><title>rank {rank} runs {escape(names)}</title></line>',
        f'<text x="{x:g}" y="{axis_y + 32}" font-size="10" fill="#d00000" text-anchor="middle">rank {rank}</text>',
    ]
