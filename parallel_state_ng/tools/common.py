"""What the command-line tools share, written once.

* :class:`UsageError`: bad input, reported on stderr with exit code 2;
* argparse types: :func:`int_at_least`, :func:`int_list`, :func:`name_list`;
* report text (``layout``, ``topology``): rank lists, plurals, dims, a group kind's entry and
  its lines, writing to ``--output``;
* SVG: the document head, a legend entry and the colours of groups and modules.

Pure formatting. The tools: docs/tools.md.
"""

from __future__ import annotations

import argparse
import colorsys
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from xml.sax.saxutils import escape

from parallel_state_ng.layout.megatron_layout import GROUP_KINDS

__all__ = [
    "UsageError",
    "int_at_least",
    "positive_int",
    "non_negative_int",
    "int_list",
    "name_list",
    "format_ranks",
    "plural",
    "dims_text",
    "kind_text",
    "kind_entry",
    "kind_lines",
    "write_output",
    "SVG_MARGIN",
    "SVG_TITLE_H",
    "svg_head",
    "svg_legend_entry",
    "group_colour",
    "text_colour",
]


class UsageError(Exception):
    """Bad command-line input, reported on stderr with exit code 2 (no traceback).

    With ``option`` the message reads ``argument OPTION: message`` (argparse's style);
    without, ``message`` must itself name the option(s) at fault.
    """

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(f"argument {option}: {message}" if option else message)
        self.option = option
        self.message = message


# --------------------------------------------------------------------------- arguments
def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            shown = text if len(text) <= 40 else text[:40] + "..."  # a hostile value must not fill the terminal
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {shown!r}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def _comma_list(text: str, what: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of {what}, got {text!r}")
    return parts


def int_list(text: str) -> list[int]:
    """An argparse type: a comma-separated list of integers >= 1."""
    return [positive_int(p) for p in _comma_list(text, "integers >= 1")]


def name_list(text: str) -> list[str]:
    """An argparse type: a comma-separated list of group kinds."""
    return _comma_list(text, "group kinds")


# --------------------------------------------------------------------------- report text
# A rank list longer than this is abbreviated to its first and last few ranks.
_RANKS_SHOWN_MAX, _RANKS_SHOWN_HEAD, _RANKS_SHOWN_TAIL = 16, 8, 2
# A kind with more groups than this shows its first and last few (unless --full).
_GROUPS_SHOWN_HEAD, _GROUPS_SHOWN_TAIL, _GROUPS_SHOWN_MAX = 3, 2, 8


def format_ranks(ranks: Sequence[int], full: bool = False) -> str:
    """A rank list for people: short lists in full, long ones abbreviated (with the count)."""
    n = len(ranks)
    if full or n <= _RANKS_SHOWN_MAX:
        return "[" + ", ".join(map(str, ranks)) + "]"
    step = ranks[1] - ranks[0]
    if step > 0 and all(ranks[i + 1] - ranks[i] == step for i in range(n - 1)):
        return f"[{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[-1]}] ({n} ranks, step {step})"
    head = ", ".join(map(str, ranks[:_RANKS_SHOWN_HEAD]))
    tail = ", ".join(map(str, ranks[-_RANKS_SHOWN_TAIL:]))
    return f"[{head}, ..., {tail}] ({n} ranks)"


def plural(count: int, noun: str) -> str:
    """``"1 rank"``, ``"2 ranks"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def dims_text(dims: Mapping[str, int]) -> str:
    """``{"tp": 2, "pp": 4}`` -> ``"tp=2 pp=4"`` (in the mapping's order)."""
    return " ".join(f"{name}={size}" for name, size in dims.items())


def kind_text(kind: str) -> tuple[str, str]:
    """(MCore ``group_desc``, description) of a group kind; ``hcpN`` is a hierarchical CP level."""
    if kind in GROUP_KINDS:
        return GROUP_KINDS[kind].desc, GROUP_KINDS[kind].what
    if kind.startswith("hcp"):
        return f"HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{kind[3:]}", f"hierarchical context parallel, level {kind[3:]}"
    return kind.upper(), kind


def kind_entry(kind: str, groups: list[list[int]]) -> dict[str, Any]:
    """A group kind in a report (JSON-ready): its description, number and size of groups, the groups."""
    desc, what = kind_text(kind)
    sizes = sorted({len(g) for g in groups})
    return {
        "desc": desc,
        "what": what,
        "num_groups": len(groups),
        "group_size": sizes[0] if len(sizes) == 1 else sizes,
        "groups": groups,
    }


def kind_lines(kind: str, info: Mapping[str, Any], full: bool, indent: str = "", pad: str = "    ") -> list[str]:
    """Text of a :func:`kind_entry`: a heading at ``indent``, the groups at ``pad`` (abbreviated unless ``full``)."""
    size = info["group_size"]
    size_text = plural(size, "rank") if isinstance(size, int) else f"{size} ranks (sizes vary)"
    lines = [f"{indent}{kind} - {info['what']} [{info['desc']}]: {plural(info['num_groups'], 'group')} of {size_text}"]
    groups = info["groups"]
    width = len(str(len(groups) - 1))
    if full or len(groups) <= _GROUPS_SHOWN_MAX:
        return lines + [f"{pad}{i:>{width}}: {format_ranks(g, full)}" for i, g in enumerate(groups)]
    tail = len(groups) - _GROUPS_SHOWN_TAIL
    lines += [f"{pad}{i:>{width}}: {format_ranks(groups[i])}" for i in range(_GROUPS_SHOWN_HEAD)]
    lines.append(f"{pad}{'':>{width}}  ... {tail - _GROUPS_SHOWN_HEAD} more groups ...")
    return lines + [f"{pad}{i:>{width}}: {format_ranks(groups[i])}" for i in range(tail, len(groups))]


def write_output(text: str, output: str | None, stdout: Any) -> None:
    """Write ``text`` to the file ``output``, or to ``stdout`` when it is ``None``.

    Raises:
        UsageError: the file cannot be written (names ``--output``).
    """
    if output is None:
        stdout.write(text)
        return
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:
        raise UsageError(f"cannot write {output!r}: {err.strerror}", "--output") from None


# --------------------------------------------------------------------------- SVG
#: Margin around an SVG picture and the height of its title and subtitle.
SVG_MARGIN, SVG_TITLE_H = 12, 44


def svg_head(width: int, height: int, title: str, subtitle: str) -> list[str]:
    """The opening lines of an SVG document: the ``<svg>`` element, a white page, title and subtitle."""
    return [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{SVG_MARGIN}" y="{SVG_MARGIN + 14}" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<text x="{SVG_MARGIN}" y="{SVG_MARGIN + 32}" font-size="11" fill="#444444">{escape(subtitle)}</text>',
    ]


def svg_legend_entry(x: int, y: int, index: int, attribute: str, text: str) -> list[str]:
    """A legend entry: a swatch of :func:`group_colour` ``(index)`` carrying ``attribute``, then ``text``."""
    return [
        f'<rect class="legend" x="{x}" y="{y - 11}" width="14" height="12" fill="{group_colour(index)}" '
        f'stroke="#666666" stroke-width="0.6" {attribute}/>',
        f'<text x="{x + 19}" y="{y}" font-size="10.5" fill="#222222">{escape(text)}</text>',
    ]


def group_colour(index: int) -> str:
    """Fill colour of group ``index``: golden-ratio hue steps, three lightness bands."""
    hue = (index * 0.6180339887) % 1.0
    lightness = (0.70, 0.84, 0.60)[index % 3]
    r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.62)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def text_colour(fill: str) -> str:
    """Dark text on light fills, white text on dark ones."""
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"
