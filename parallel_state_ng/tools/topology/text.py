"""The ``topology`` command's text report: modules, their groups and ``--rank``'s view, for people.

:func:`render_topology_text` writes what
:func:`~parallel_state_ng.tools.topology.report.build_topology_report` returns. Unless
``--full``: long rank and group lists abbreviated, long span lists shown by their ends, and a
module shaped like one listed before it summarised on one line (runs of them together). Pure
formatting. The tool: docs/tools.md#topology-tool.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from parallel_state_ng.tools.common import kind_lines, plural
from parallel_state_ng.tools.layout.report import rank_view_lines

__all__ = ["render_topology_text"]

# More spans than this show their first and last few (unless --full).
_SPANS_SHOWN_MAX, _SPANS_SHOWN_HEAD, _SPANS_SHOWN_TAIL = 8, 3, 2


def _span(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}..{ranks[1] - 1}"


def _sizes_text(module: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in module["sizes"].items()) + f" order={module['order']}"


def _module_lines(m: dict[str, Any], full: bool) -> list[str]:
    note = "" if full else "; long lists abbreviated, --full prints all"
    lines = [
        "",
        f"Module {m['name']}: ranks {_span(m['ranks'])} ({plural(m['num_ranks'], 'rank')})"
        + (f", colocated with {', '.join(m['colocated_with'])}" if m["colocated_with"] else ""),
        f"  sizes: {_sizes_text(m)}",
        "  language module: yes (embedding groups)" if m["language"] else "  language module: no (no embedding groups)",
    ]
    if m["options"]:
        lines.append("  options: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in m["options"].items()))
    lines.append(f"  groups ({plural(len(m['kinds']), 'kind')}{note}):")
    for kind, info in m["kinds"].items():
        lines += kind_lines(kind, info, full, "    ", "      ")
    return lines


def _alike_line(run: Sequence[dict[str, Any]], like_start: int) -> str:
    """One line for modules shaped like ``run[0]["shaped_like"]``, one after another on the ranks."""
    first, last, like = run[0], run[-1], run[0]["shaped_like"]
    if len(run) == 1:
        shift = first["ranks"][0] - like_start
        return (
            f"Module {first['name']}: ranks {_span(first['ranks'])} ({plural(first['num_ranks'], 'rank')}): "
            f"shaped like {like}, groups shifted by {shift:+d} (--full lists them)"
        )
    ranks = f"{first['ranks'][0]}..{last['ranks'][1] - 1}"
    return (
        f"Modules {first['name']} to {last['name']} ({len(run)} modules, ranks {ranks}, "
        f"{plural(first['num_ranks'], 'rank')} each in turn): shaped like {like}, groups shifted by each "
        f"module's first rank (--full lists them)"
    )


def _follows(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return (
        after.get("shaped_like") == before["shaped_like"]
        and not after["colocated_with"]
        and after["ranks"][0] == before["ranks"][1]
    )


def render_topology_text(report: dict[str, Any], full: bool = False) -> str:
    """The report for people (long lists abbreviated unless ``full``).

    Unless ``full``: more than 8 spans show their first 3 and last 2; a module shaped like one
    listed before it (``shaped_like``, not colocated) gets one line, and modules of that shape
    one after another on the ranks share one line. Those modules' ``kinds`` are not read
    (:func:`build_topology_report` with ``alike_groups=False`` leaves them out).
    """
    modules = report["modules"]
    lines = [
        f"Topology of {report['world_size']} ranks, {plural(len(modules), 'module')}, megatron-core "
        f"{report['release']} (pure layout math: no processes, no GPUs)",
        f"language module: {report['language_module']}",
    ]
    spans, hidden = report["spans"], 0
    if not full and len(spans) > _SPANS_SHOWN_MAX:
        hidden = len(spans) - _SPANS_SHOWN_HEAD - _SPANS_SHOWN_TAIL
        spans = spans[:_SPANS_SHOWN_HEAD] + spans[-_SPANS_SHOWN_TAIL:]
    width = max(len(_span(s["ranks"])) for s in spans)
    for i, span in enumerate(spans):
        if hidden and i == _SPANS_SHOWN_HEAD:
            lines.append(f"  ... {hidden} more spans (each module's ranks: below, --full or --format json) ...")
        together = " + ".join(span["modules"]) + (" (colocated)" if len(span["modules"]) > 1 else "")
        lines.append(f"  ranks {_span(span['ranks']):<{width}}  {together}")
    starts: dict[str, int] = {}
    i = 0
    while i < len(modules):
        m = modules[i]
        starts.setdefault(m["name"], m["ranks"][0])
        if full or m.get("shaped_like") is None or m["colocated_with"]:
            lines += _module_lines(m, full)
            i += 1
            continue
        end = i + 1
        while end < len(modules) and _follows(modules[end - 1], modules[end]):
            end += 1
        lines += ["", _alike_line(modules[i:end], starts[m["shaped_like"]])]
        i = end
    view = report["rank"]
    if view is not None:
        runs = f"{plural(len(view['modules']), 'module')}: {', '.join(view['modules'])}"
        lines += ["", f"Rank {view['rank']} runs {runs}"]
        for name, v in view["views"].items():
            lines += [f"  {name}:", *rank_view_lines(v, full, "    ", position_width=18)]
    return "\n".join(lines) + "\n"
