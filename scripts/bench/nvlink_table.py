"""NVLink-domain crossings of published rack-scale shapes, before and after the suggested order.

GB200/GB300 NVL72 (72 GPUs per NVLink domain): worlds of 144 and 288 GPUs (2 and 4 racks, every
GPU used) and 128 and 256 GPUs (64 of each 72 used, and 128 with all 72 used: the naive
placement), tp 2/4/8, pp 2/4/8, ep 8/16/64, etp 1 or tp. Each configuration Megatron-Core
accepts (``MegatronLayout`` validates it) is one row: the latency-critical kinds (tp, cp, ep,
ep_tp, tp_ep_mp) that cross a domain under the default order, the best accepted order
(``layout --suggest-order``) and what still crosses there, with the reason when nothing fits.
Pure layout math. Prints a markdown table (docs/results/nvlink.md); ``--json`` prints the rows.
``--check-cost N`` instead times the runtime check's two steps for N simulated ranks (64 per
domain, or ``--per-domain``; NVML-style ids): the comparing rank's summary and one rank's check
of the layout (``--repeat`` times after a garbage collection, so that the collection of the
simulated ids does not land in it: the fastest and slowest run).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import re
import time
from collections.abc import Sequence
from typing import Any

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.nvlink_domains import LATENCY_CRITICAL_KINDS, NvlinkDomains
from parallel_state_ng.layout.nvlink_suggest import score_layout, suggest_fill, suggest_orders, why_crossing

RELEASE = "0.19"
TRAY = 4  # GPUs per compute tray: the step of the GPUs-per-domain suggestion
#: (world size, GPUs per domain, GPUs used per domain)
MACHINES = ((144, 72, 72), (288, 72, 72), (128, 72, 72), (128, 72, 64), (256, 72, 64))
TP, PP, EP = (2, 4, 8), (2, 4, 8), (8, 16, 64)


def _short(reason: str) -> str:
    """A :func:`why_crossing` reason in a table cell: ``ep: 16 does not divide 72``."""
    reason = re.sub(
        r"(\w+) groups have (\d+) ranks, which does not divide the (\d+) ranks .*", r"\1: \2 does not divide \3", reason
    )
    return re.sub(r"(\w+) groups have (\d+) ranks, more than the (\d+) ranks of a domain", r"\1: \2 > \3", reason)


def _crossing_text(crossing: dict[str, int], kinds: tuple[str, ...]) -> str:
    return ", ".join(f"{k} {crossing[k]}" for k in kinds) or "none"


def row(world: int, size: int, used: int, tp: int, pp: int, ep: int, etp: int) -> dict[str, Any] | None:
    """One configuration's row (``None``: the release refuses the configuration)."""
    arguments = {
        "world_size": world,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "release": RELEASE,
    }
    try:
        layout = MegatronLayout(**arguments)
    except (RuntimeError, AssertionError, ValueError):
        return None
    domains = NvlinkDomains(size, used)
    before = score_layout(layout, domains, LATENCY_CRITICAL_KINDS)
    best = suggest_orders(arguments, domains, LATENCY_CRITICAL_KINDS)[0]
    fill = suggest_fill(arguments, domains, LATENCY_CRITICAL_KINDS, TRAY) if best.crossing_kinds else None
    return {
        "world": world,
        "domain": size if used == size else f"{used}/{size}",
        "tp": tp,
        "pp": pp,
        "dp": layout.data_parallel_size,
        "ep": ep,
        "etp": etp,
        "default": _crossing_text(dict(before.crossing), before.crossing_kinds),
        "best_order": best.order,
        "after": _crossing_text(dict(best.crossing), best.crossing_kinds),
        "why": "; ".join(_short(r) for r in why_crossing(layout, domains, best.crossing_kinds)),
        "fill": None if fill is None else f"{fill[0]}/{size}, `{fill[1].order}`",
    }


def rows() -> list[dict[str, Any]]:
    """One row per accepted configuration (see the module docstring)."""
    out = []
    for (world, size, used), tp, pp, ep in itertools.product(MACHINES, TP, PP, EP):
        for etp in dict.fromkeys((1, tp)):
            found = row(world, size, used, tp, pp, ep, etp)
            if found is not None:
                out.append(found)
    return out


def markdown_row(r: dict[str, Any]) -> str:
    """One row of the markdown table."""
    return (
        f"| {r['world']} | {r['domain']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['ep']} | {r['etp']} "
        f"| {r['default']} | `{r['best_order']}` | {r['after']} | {r['why']} | {r['fill'] or 'none'} |"
    )


def markdown(table: list[dict[str, Any]]) -> str:
    """The rows where something crosses under the default order as a markdown table, then the
    number of the other (clean) rows per machine.
    """
    head = (
        "| world | domain | tp | pp | dp | ep | etp | crossing, default order (groups) | suggested order "
        "| crossing after | why it still crosses | GPUs used per domain that fit, order |"
    )
    lines = [head, "|" + "---|" * 12]
    clean: dict[str, int] = {}
    for r in table:
        if r["default"] == "none":
            key = f"world {r['world']} on domains of {r['domain']}"
            clean[key] = clean.get(key, 0) + 1
            continue
        lines.append(markdown_row(r))
    lines.append("")
    lines.append(
        "Nothing crosses under the default order in the other accepted configurations: "
        + "; ".join(f"{key}: {n}" for key, n in clean.items())
        + "."
    )
    return "\n".join(lines) + "\n"


def _status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB; ``None`` off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident size (Linux ``clear_refs``); whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def check_cost(world: int, per_domain: int = 64, repeat: int = 3) -> dict[str, Any]:
    """Milliseconds of the runtime check's summary and per-rank check for ``world`` ranks (tp 4,
    pp 4, ep 16, etp 1; ``per_domain`` ranks per domain), and the summary's size in bytes. The
    check runs ``repeat`` times: ``check_ms`` is the fastest run, ``check_ms_slowest`` the slowest;
    ``check_peak_mib`` is how far the first run raised the resident size (Linux; else ``None``).
    """
    from parallel_state_ng.groups.agreement import AgreementResult
    from parallel_state_ng.groups.nvlink_check import encode_domain_id, summarize_domain_ids
    from parallel_state_ng.groups.pipeline import check_nvlink_domains

    for value, name in ((world, "world"), (per_domain, "per_domain"), (repeat, "repeat")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    ids = [encode_domain_id(("nvml", ("ab" * 16, r // per_domain))) for r in range(world)]
    start = time.perf_counter()
    summary = summarize_domain_ids(range(world), ids)
    summarized = time.perf_counter() - start
    del ids  # one rank's check holds only the summary
    layout = MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=4,
        expert_model_parallel_size=16,
        expert_tensor_parallel_size=1,
        release=RELEASE,
    )
    result = AgreementResult("init", False, "agreed", world, summary=summary)
    runs: list[float] = []
    peak_mib = None
    for _ in range(repeat):
        gc.collect()
        resident = _status_kib("VmRSS") if not runs and _reset_peak_rss() else None
        start = time.perf_counter()
        findings = check_nvlink_domains(result, {"": layout}, name="init", rank=1)
        runs.append(time.perf_counter() - start)
        peak = _status_kib("VmHWM")
        if resident is not None and peak is not None:
            peak_mib = round((peak - resident) / 1024, 1)
    return {
        "world": world,
        "per_domain": per_domain,
        "summary_ms": round(summarized * 1000, 1),
        "summary_bytes": len(json.dumps(summary)),
        "check_ms": round(min(runs) * 1000, 1),
        "check_ms_slowest": round(max(runs) * 1000, 1),
        "check_peak_mib": peak_mib,
        "findings": len(findings),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (markdown, or JSON with ``--json``), or the check's cost (``--check-cost``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--check-cost", type=int, default=None, metavar="N", help="time the runtime check at N ranks")
    parser.add_argument("--per-domain", type=int, default=64, metavar="K", help="--check-cost: ranks per domain")
    parser.add_argument("--repeat", type=int, default=3, metavar="R", help="--check-cost: runs of the check")
    args = parser.parse_args(argv)
    if args.check_cost is not None:
        try:
            print(json.dumps(check_cost(args.check_cost, args.per_domain, args.repeat)))
        except ValueError as err:
            parser.error(f"--check-cost/--per-domain/--repeat: {err}")
        return
    table = rows()
    print(json.dumps(table, indent=1) if args.json else markdown(table), end="")


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "nvlink_table")
