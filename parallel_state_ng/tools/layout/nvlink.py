"""NVLink domains in the layout tool: ``--nvlink-domain-size``, ``--gpus-used-per-domain``,
``--keep-inside`` and ``--suggest-order``.

The math is :mod:`parallel_state_ng.layout.nvlink_domains` (which groups cross a domain) and
:mod:`parallel_state_ng.layout.nvlink_suggest` (orders that keep kinds inside); this module
reads the options, adds an ``"nvlink"`` section to the report and writes its text. The topology
tool reuses the options and the text pieces. The tool: docs/nvlink.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from parallel_state_ng.layout.megatron_layout import GROUP_KINDS, MegatronLayout
from parallel_state_ng.layout.nvlink_domains import (
    LATENCY_CRITICAL_KINDS,
    NvlinkDomains,
    crossing_report,
    kinds_crossing,
)
from parallel_state_ng.layout.nvlink_suggest import suggest_fill, suggest_orders, why_crossing
from parallel_state_ng.layout.snapshot import layout_config
from parallel_state_ng.tools.common import UsageError, format_ranks, name_list, plural, positive_int

__all__ = [
    "add_domain_arguments",
    "domains_from_args",
    "keep_inside_from_args",
    "node_size_for_domains",
    "layout_arguments",
    "nvlink_section",
    "render_nvlink",
    "render_crossing_table",
    "DEFAULT_TOP",
    "TRAY_GPUS",
]

#: Candidates listed by ``--suggest-order`` unless ``--top`` says otherwise.
DEFAULT_TOP = 5
#: GPUs per compute tray of a GB200/GB300 NVL72 rack: the node size when domains are given.
TRAY_GPUS = 4


def add_domain_arguments(parser: argparse.ArgumentParser, suggest_option: str, suggest_help: str) -> None:
    """Add the domain options (and the tool's suggestion switch ``suggest_option``) to ``parser``."""
    group = parser.add_argument_group("NVLink domains (docs/nvlink.md)")
    group.add_argument(
        "--nvlink-domain-size",
        type=positive_int,
        default=None,
        help="GPUs per NVLink domain (72 on GB200/GB300 NVL72): report the groups that cross a domain",
    )
    group.add_argument(
        "--gpus-used-per-domain",
        type=positive_int,
        default=None,
        help="GPUs of each domain the job uses (default: all); rank r sits in domain r // this",
    )
    group.add_argument(
        "--keep-inside",
        type=name_list,
        default=None,
        help=f"group kinds that must stay inside a domain (default {','.join(LATENCY_CRITICAL_KINDS)})",
    )
    group.add_argument(suggest_option, action="store_true", help=suggest_help)
    group.add_argument(
        "--top", type=positive_int, default=DEFAULT_TOP, help=f"candidates to list (default {DEFAULT_TOP})"
    )


def domains_from_args(args: argparse.Namespace, suggest_option: str, suggest: bool) -> NvlinkDomains | None:
    """The domains of the parsed options (``None``: none given); bad combinations raise :class:`UsageError`."""
    size, used = args.nvlink_domain_size, args.gpus_used_per_domain
    if size is None:
        for option, given in (
            ("--gpus-used-per-domain", used is not None),
            ("--keep-inside", args.keep_inside is not None),
            (suggest_option, suggest),
        ):
            if given:
                raise UsageError("needs --nvlink-domain-size (GPUs per NVLink domain, e.g. 72)", option)
        return None
    if used is not None and used > size:
        raise UsageError(
            f"{used} is larger than --nvlink-domain-size {size}: a domain holds at most {size} GPUs",
            "--gpus-used-per-domain",
        )
    return NvlinkDomains(size, used)


def keep_inside_from_args(args: argparse.Namespace) -> list[str]:
    """``--keep-inside`` (default :data:`LATENCY_CRITICAL_KINDS`), each a known group kind."""
    if args.keep_inside is None:
        return list(LATENCY_CRITICAL_KINDS)
    unknown = [k for k in args.keep_inside if k not in GROUP_KINDS]
    if unknown:
        raise UsageError(f"unknown group kind(s) {unknown}; known kinds: {','.join(GROUP_KINDS)}", "--keep-inside")
    return list(args.keep_inside)


def node_size_for_domains(domains: NvlinkDomains, world_size: int, requested: int | None) -> int:
    """The node size under domains: ``requested`` (must divide a domain's ranks), else a tray of
    :data:`TRAY_GPUS` where it divides the domain's ranks and the world, else one GPU.
    """
    per = domains.ranks_per_domain
    if requested is None:
        return TRAY_GPUS if per % TRAY_GPUS == 0 and world_size % TRAY_GPUS == 0 else 1
    if per % requested:
        raise UsageError(
            f"{requested} does not divide the {per} ranks of a domain (a node cannot straddle two NVLink domains)",
            "--gpus-per-node",
        )
    return requested


def layout_arguments(layout: MegatronLayout) -> dict[str, Any]:
    """``MegatronLayout`` arguments that rebuild ``layout`` under another order."""
    arguments = layout_config(layout)  # the snapshot's configuration: every shape argument
    del arguments["order"]
    hcp = arguments["hierarchical_context_parallel_sizes"]
    arguments["hierarchical_context_parallel_sizes"] = None if hcp is None else tuple(hcp)
    arguments.update(rank_offset=layout.rank_offset, local_world_size=layout.local_world_size, release=layout.release)
    return arguments


def nvlink_section(
    layout: MegatronLayout,
    domains: NvlinkDomains,
    keep_inside: Sequence[str],
    *,
    kinds: Sequence[str] | None = None,
    suggest: bool = False,
    top: int = DEFAULT_TOP,
    node_size: int = 1,
) -> dict[str, Any]:
    """The report's ``"nvlink"`` section: domains, crossing stats per kind, kept kinds crossing,
    and with ``suggest`` the best orders; when none keeps every kind inside, why, and the most
    GPUs per domain (a multiple of ``node_size``) with which one does (``"fill"``).
    """
    built = layout.kinds()
    shown = [k for k in dict.fromkeys([*(built if kinds is None else kinds), *keep_inside]) if k in built]
    stats = crossing_report({k: layout.enumerate(k) for k in shown}, domains.domain_of)
    crossing = kinds_crossing(stats, keep_inside)
    section: dict[str, Any] = {
        "domains": domains.describe(layout.world_size),
        "keep_inside": list(keep_inside),
        "kinds": stats,
        "crossing_kinds": crossing,
    }
    if suggest:
        arguments = layout_arguments(layout)
        if layout.local_world_size is None:
            del arguments["rank_offset"], arguments["local_world_size"]
        candidates = suggest_orders(arguments, domains, keep_inside)
        section["suggestions"] = [c.as_dict() for c in candidates[:top]]
        section["orders_tried"] = sum(1 + len(c.same_as) for c in candidates)
        best = candidates[0] if candidates else None
        stuck = best is not None and best.crossing_kinds
        section["why_not"] = why_crossing(layout, domains, keep_inside) if stuck else []
        fill = suggest_fill(arguments, domains, keep_inside, node_size) if stuck else None
        section["fill"] = (
            None
            if fill is None
            else {
                "gpus_used_per_domain": fill[0],
                "order": fill[1].order,
                "num_domains": NvlinkDomains(domains.domain_size, fill[0]).num_domains(layout.world_size),
            }
        )
    return section


# --------------------------------------------------------------------------- text
def _histogram_text(histogram: Mapping[str, int]) -> str:
    return ", ".join(f"{count}x{domains}" for domains, count in histogram.items())


def render_crossing_table(stats: Mapping[str, Mapping[str, Any]], keep_inside: Sequence[str], indent: str) -> list[str]:
    """One line per kind: groups, the most domains a group spans, the histogram, crossing groups."""
    width = max([4, *(len(k) for k in stats)])
    head = f"{'kind':<{width}}  {'groups':>6}  {'max domains':>11}  {'crossing':>8}  groups x domains spanned"
    lines = [indent + head]
    for kind, s in stats.items():
        mark = "  <- keep inside" if kind in keep_inside and s["crossing_groups"] else ""
        lines.append(
            f"{indent}{kind:<{width}}  {s['num_groups']:>6}  {s['max_domains']:>11}  {s['crossing_groups']:>8}  "
            f"{_histogram_text(s['histogram'])}{mark}"
        )
    return lines


def _crossing_lines(section: Mapping[str, Any], indent: str) -> list[str]:
    kept = ",".join(section["keep_inside"])
    if not section["crossing_kinds"]:
        return [f"{indent}kinds kept inside a domain ({kept}): none crosses."]
    lines = [f"{indent}WARNING: kinds that should stay inside a domain ({kept}) cross one:"]
    for kind in section["crossing_kinds"]:
        s = section["kinds"][kind]
        for example in s["examples"]:
            lines.append(
                f"{indent}  {kind}: {s['crossing_groups']} of {s['num_groups']} groups, e.g. "
                f"{format_ranks(example['ranks'])} in domains {example['domains']}"
            )
            break
    return lines


def _suggestion_lines(section: Mapping[str, Any], option: str) -> list[str]:
    kept = ",".join(section["keep_inside"])
    candidates = section["suggestions"]
    lines = ["", f"{option} ({section['orders_tried']} accepted orders tried, same layouts merged), best first:"]
    if not candidates:
        return [*lines, "  none: the release accepts no order for this configuration"]
    for c in candidates:
        groups = c["crossing_groups"]
        crossing = ", ".join(f"{k} ({plural(groups[k], 'group')})" for k in c["crossing_kinds"]) or "nothing"
        same = f"  (same layout: {', '.join(c['same_as'][:3])}{', ...' if len(c['same_as']) > 3 else ''})"
        lines.append(f"  --order {c['order']}: crossing {crossing}{same if c['same_as'] else ''}")
    if candidates[0]["crossing_kinds"]:
        lines.append(f"  no accepted order keeps every one of {kept} inside a domain:")
        reasons = section["why_not"] or [
            "each kind fits on its own, but no order places the groups of all of them inside domains at once"
        ]
        lines += [f"    - {r}" for r in reasons]
        fill = section.get("fill")
        if fill:
            lines.append(
                f"  --gpus-used-per-domain {fill['gpus_used_per_domain']} with --order {fill['order']} keeps them "
                f"inside ({fill['num_domains']} domains, GPUs left unused in each)"
            )
        else:
            lines.append("  no number of GPUs used per domain keeps them all inside either")
    else:
        lines.append(f"  the first keeps {kept} inside a domain")
    return lines


def render_nvlink(section: Mapping[str, Any], suggest_option: str = "--suggest-order") -> str:
    """The text of a layout report's ``"nvlink"`` section."""
    d = section["domains"]
    last = "" if d["ranks_in_last_domain"] == d["ranks_per_domain"] else f", the last holds {d['ranks_in_last_domain']}"
    used = "" if d["ranks_per_domain"] == d["domain_size"] else f", {d['ranks_per_domain']} of {d['domain_size']} used"
    lines = [
        "",
        f"NVLink domains: {d['num_domains']} of {d['domain_size']} GPUs{used} (domain = rank // "
        f"{d['ranks_per_domain']}{last}):",
        *render_crossing_table(section["kinds"], section["keep_inside"], "  "),
        *_crossing_lines(section, ""),
    ]
    if "suggestions" in section:
        lines += _suggestion_lines(section, suggest_option)
    return "\n".join(lines) + "\n"
