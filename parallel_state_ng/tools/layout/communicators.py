"""Communicators per rank with and without group sharing (``layout --share``).

Feeds the rank's group plan (:func:`parallel_state_ng.layout.plan.group_plan`) to a
:class:`~parallel_state_ng.groups.sharing.GroupPool` under
:func:`~parallel_state_ng.groups.sharing.record_requests` (nothing is created, no processes):
once as Megatron-Core does it (one communicator per group kind) and once with sharing on
(``PSNG_SHARE_GROUPS=1``), where kinds with identical rank lists and options share one. The
tool: docs/tools.md#communicators-per-rank-and-group-sharing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from parallel_state_ng.groups.sharing import GroupPool, PlannedGroup, record_requests
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, PlanOptions, group_plan

__all__ = ["planned_groups", "communicator_report"]


def planned_groups(layout: MegatronLayout, rank: int, *, gloo: bool, share: bool) -> list[PlannedGroup]:
    """The groups initialize_model_parallel (default options) would create on ``rank``."""
    init_timeout = timedelta(minutes=30)
    with record_requests(share=share) as planned:
        pool = GroupPool()
        for step in group_plan(layout, rank, PlanOptions(create_gloo_process_groups=gloo)):
            if isinstance(step, CreateGroup):
                pool.get(
                    step.ranks,
                    timeout=init_timeout if step.timeout == "init" else None,
                    backend=step.backend,
                    pg_options=None,
                    group_desc=step.desc,
                )
    return list(planned)


def communicator_report(layout: MegatronLayout, ranks: list[int], *, gloo: bool) -> dict[str, Any]:
    """Per rank: communicators without and with sharing, and which kinds share."""
    out: dict[str, Any] = {"gloo_twins": gloo, "ranks": {}}
    for rank in dict.fromkeys(ranks):
        without = planned_groups(layout, rank, gloo=gloo, share=False)
        shared = planned_groups(layout, rank, gloo=gloo, share=True)
        out["ranks"][str(rank)] = {
            "without_sharing": len(without),
            "with_sharing": len(shared),
            "shared": [g.descs for g in shared if len(g.descs) > 1],
        }
    return out


def render_communicators(info: dict[str, Any]) -> list[str]:
    """Text lines for :func:`communicator_report`'s data."""
    twins = "on" if info["gloo_twins"] else "off"
    lines = [
        "",
        f"Communicators per rank (initialize_model_parallel defaults, gloo twins {twins}; "
        "sharing: PSNG_SHARE_GROUPS=1):",
        f"  {'rank':>9}  {'without sharing':>15}  {'with sharing':>12}",
    ]
    for rank, entry in info["ranks"].items():
        lines.append(f"  {rank:>9}  {entry['without_sharing']:>15}  {entry['with_sharing']:>12}")
    for rank, entry in info["ranks"].items():
        if entry["shared"]:
            lines.append(f"  one group with sharing on rank {rank}:")
            lines += [f"    {' = '.join(descs)}" for descs in entry["shared"]]
    return lines
