"""Store traffic of one init per rank: compat (member and split path) against MCore, on gloo worlds.

For each world size and store kind (``FileStore``, ``TCPStore``) a
:class:`~parallel_state_ng.testing.worlds.GlooWorld` runs
:func:`scripts.bench.init_phases.rank_init_phases` on every rank: the default group's store is
counted (:mod:`parallel_state_ng.testing.store_traffic`) through ``initialize_model_parallel``
and the first all-reduce on every group. Printed per implementation: store operations per rank
by category (agreement round, arrival marks, closing round, readiness marks, the
communicators' own connection traffic, the CPU stand-in for NCCL's split), operations per split,
``new_group`` / ``split_group`` calls, and seconds (slowest rank). A benchmark: it asserts
nothing about time. Figures and method: docs/results/performance.md ("Store traffic").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from scripts.bench.init_phases import rank_init_phases

#: (implementation, creation path) pairs measured by default.
CASES = (("compat", "member"), ("compat", "split"), ("mcore", "member"))
CATEGORY_ORDER = ("agreement", "arrival", "closing", "readiness", "connect", "stand-in", "barrier", "other")


def measure(world: int, layout: str, stores: list[str], cases: list[tuple[str, str]], rounds: int) -> list[dict]:
    """Every rank's records for each (store, case) on one ``world``-rank gloo world."""
    from scripts.harness.worlds import QUIET, open_world

    out: list[dict] = []
    with open_world(world, timeout=900, start_timeout=600, env=QUIET) as gloo:
        for store in stores:
            for impl, path in cases:
                per_rank = gloo.run(rank_init_phases, impl, layout, store, path, rounds)
                for records in per_rank:
                    out.extend(records)
    return out


def per_rank_ops(records: list[dict], phase: str = "init_traffic") -> dict[str, float]:
    """Median over ranks and rounds of each category's operations per rank."""
    categories = sorted({c for r in records for c in r[phase]})
    return {c: statistics.median(r[phase].get(c, {}).get("ops", 0) for r in records) for c in categories}


def summarize(records: list[dict]) -> list[dict]:
    """One row per (world, store, impl, path)."""
    keys = sorted({(r["world"], r["store"], r["impl"], r["path"]) for r in records}, key=str)
    rows = []
    for world, store, impl, path in keys:
        mine = [r for r in records if (r["world"], r["store"], r["impl"], r["path"]) == (world, store, impl, path)]
        ops = per_rank_ops(mine)
        splits = statistics.median(r["split_calls"] for r in mine)
        protocol = sum(ops.get(c, 0) for c in ("agreement", "arrival", "closing", "readiness"))
        slowest = [max(r["init_s"] for r in mine if r["round"] == i) for i in sorted({r["round"] for r in mine})]
        rows.append(
            {
                "world": world,
                "store": store,
                "impl": impl,
                "path": path,
                "ops": ops,
                "protocol_ops": protocol,
                "protocol_s": statistics.median(
                    sum(r["init_traffic"].get(c, {}).get("seconds", 0.0) for c in ("agreement", "arrival", "closing"))
                    for r in mine
                ),
                "connect_s": statistics.median(r["init_traffic"].get("connect", {}).get("seconds", 0.0) for r in mine),
                "new_group_calls": statistics.median(r["new_group_calls"] for r in mine),
                "split_calls": splits,
                "ops_per_split": (ops.get("arrival", 0) / splits) if splits else None,
                "agreement_s": statistics.median(r["agreement_s"] for r in mine),
                "init_s": statistics.median(slowest),
                "first_use_s": statistics.median(r["first_use_s"] for r in mine),
                "use_ops": per_rank_ops(mine, "use_traffic"),
            }
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    """The table: one line per row, store operations per rank by category."""
    head = (
        f"{'W':>3} {'store':<8} {'impl':<6} {'path':<6} | "
        + " ".join(f"{c[:9]:>9}" for c in CATEGORY_ORDER)
        + f" | {'protocol':>8} {'per split':>9} {'new_group':>9} {'split':>5} | "
        f"{'agree s':>7} {'proto s':>7} {'conn s':>7} {'init s':>7} {'1st use s':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = " ".join(f"{r['ops'].get(c, 0):9.0f}" for c in CATEGORY_ORDER)
        per_split = f"{r['ops_per_split']:9.2f}" if r["ops_per_split"] is not None else f"{'—':>9}"
        print(
            f"{r['world']:>3} {r['store']:<8} {r['impl']:<6} {r['path']:<6} | {cells} | {r['protocol_ops']:8.0f} "
            f"{per_split} {r['new_group_calls']:9.0f} {r['split_calls']:5.0f} | {r['agreement_s']:7.3f} "
            f"{r['protocol_s']:7.3f} {r['connect_s']:7.3f} {r['init_s']:7.3f} {r['first_use_s']:9.3f}"
        )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, measure and print; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="4,8", help="comma-separated numbers of gloo processes")
    p.add_argument("--layout", default="tp2-pp2", help="e.g. tp2-pp2, tp2-pp2-ep2")
    p.add_argument("--stores", default="file,tcp", help="subset of launcher,file,tcp")
    p.add_argument("--cases", default=",".join(f"{i}:{p}" for i, p in CASES), help="impl:path,...")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write every record and the rows here")
    a = p.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",") if c]
    stores = [s for s in a.stores.split(",") if s]
    started = time.time()
    load = os.getloadavg()
    print(f"store traffic per rank of one initialize_model_parallel ({a.layout}), gloo; load {load[0]:.1f}")
    records: list[dict[str, Any]] = []
    for world in (int(w) for w in a.worlds.split(",")):
        records += measure(world, a.layout, stores, cases, a.rounds)  # type: ignore[arg-type]
    rows = summarize(records)
    print_rows(rows)
    print(
        "ops: median store operations per rank by key category; protocol = agreement + arrival + closing + "
        "readiness (what compat adds to creating communicators); per split = arrival marks per split call; "
        "connect = the communicators' own traffic (gloo connection; NCCL's unique id); stand-in = the CPU "
        f"stand-in for NCCL's split (none on NCCL); seconds: median over ranks, init s the slowest rank's; "
        f"load after {os.getloadavg()[0]:.1f}; took {time.time() - started:.0f} s"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "store_traffic")
