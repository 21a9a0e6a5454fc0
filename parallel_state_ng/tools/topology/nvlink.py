"""NVLink domains in the topology tool: each module's crossing groups, ``--suggest-placement``.

The options are the layout tool's (:mod:`parallel_state_ng.tools.layout.nvlink`);
``--suggest-placement`` lists arrangements of the module spans along the rank axis (each
module's ``rank_offset``) with each module's best ``order``
(:func:`~parallel_state_ng.layout.nvlink_suggest.suggest_placements`). The tool: docs/nvlink.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from parallel_state_ng.layout.nvlink_domains import NvlinkDomains
from parallel_state_ng.layout.nvlink_suggest import suggest_placements
from parallel_state_ng.layout.topology_spec import ModulePlacement
from parallel_state_ng.tools.common import plural
from parallel_state_ng.tools.layout.nvlink import nvlink_section, render_crossing_table

__all__ = ["SUGGEST_OPTION", "topology_nvlink_section", "render_topology_nvlink"]

SUGGEST_OPTION = "--suggest-placement"


def topology_nvlink_section(
    placements: Sequence[ModulePlacement],
    domains: NvlinkDomains,
    keep_inside: Sequence[str],
    module_kinds: Mapping[str, Sequence[str]],
    *,
    kinds: Sequence[str] | None = None,
    suggest: bool = False,
    top: int = 5,
) -> dict[str, Any]:
    """The topology report's ``"nvlink"`` section: domains, each module's crossing stats (the
    ``kinds`` shown, default all, and every kept kind the module builds; ``module_kinds``: name ->
    the kinds it builds), and with ``suggest`` the best arrangements of the modules.
    """
    world = placements[0].layout.world_size
    modules = {}
    for p in placements:
        own = module_kinds[p.name]
        kept = [k for k in keep_inside if k in own]
        modules[p.name] = nvlink_section(p.layout, domains, kept, kinds=[k for k in own if kinds is None or k in kinds])
        del modules[p.name]["domains"]
    section: dict[str, Any] = {
        "domains": domains.describe(world),
        "keep_inside": list(keep_inside),
        "modules": modules,
        "crossing_kinds": [f"{n}:{k}" for n, m in modules.items() for k in m["crossing_kinds"]],
    }
    if suggest:
        series = placements[0].layout.release or ""
        section["suggestions"] = suggest_placements(placements, domains, keep_inside, series=series, limit=top)
    return section


def render_topology_nvlink(section: Mapping[str, Any]) -> str:
    """The text of a topology report's ``"nvlink"`` section."""
    d = section["domains"]
    used = "" if d["ranks_per_domain"] == d["domain_size"] else f", {d['ranks_per_domain']} of {d['domain_size']} used"
    lines = [
        "",
        f"NVLink domains: {d['num_domains']} of {d['domain_size']} GPUs{used} (domain = rank // "
        f"{d['ranks_per_domain']}):",
    ]
    for name, m in section["modules"].items():
        lines.append(f"  module {name}:")
        lines += render_crossing_table(m["kinds"], m["keep_inside"], "    ")
    kept = ",".join(section["keep_inside"])
    if section["crossing_kinds"]:
        lines.append(
            f"WARNING: kinds that should stay inside a domain ({kept}) cross one: "
            + ", ".join(section["crossing_kinds"])
        )
    else:
        lines.append(f"kinds kept inside a domain ({kept}): none crosses.")
    if "suggestions" in section:
        lines += ["", f"{SUGGEST_OPTION}: module spans along the rank axis, each module with its best order:"]
        for s in section["suggestions"]:
            crossing = ", ".join(s["crossing_kinds"]) or "nothing"
            placed = "; ".join(
                f"{n} ranks {m['ranks'][0]}..{m['ranks'][1] - 1} order {m['order']}" for n, m in s["modules"].items()
            )
            lines.append(f"  {placed}: crossing {crossing} ({plural(s['crossing_groups'], 'group')})")
        if not section["suggestions"]:
            lines.append("  none: no arrangement is a valid topology")
    return "\n".join(lines) + "\n"
