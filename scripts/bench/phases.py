"""Time to usable groups, phase by phase, compat against MCore in one world, and a scale model.

Every rank runs :func:`scripts.bench.init_phases.rank_init_phases` for each implementation in
turn (same processes, rounds interleaved): agreement round, ``new_group`` / ``split_group``
calls, closing round, store traffic, first collective on every group. The slowest rank's
phases are printed per world size; from two or more sizes each phase is fitted as
``a + b * W`` (MCore's creation as calls(W) x seconds per call(W): its calls grow with the
world, and on a bound device each is a world-wide split) and extrapolated to 1,024 and 65,536
ranks. A benchmark: it asserts nothing about time. ``--launcher gloo`` runs CPU gloo worlds;
``--launcher gpu`` the one-GPU NCCL world of :mod:`scripts.gpu.world` (:func:`gpu_world`, a
device-bound default group). Method and figures: docs/results/performance.md ("Phases and a scale
model"); on NCCL, time to usable groups per world size and its projection are the GPU check's
ladder (:mod:`scripts.gpu.world_ladder`, which fits with :func:`fit`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from scripts.bench.init_phases import rank_init_phases

PHASES = ("agreement_s", "create_s", "closing_s", "protocol_store_s", "first_use_s", "total_s")
MODEL_WORLDS = (1024, 65536)
Launcher = Callable[[int, Callable[..., Any], Sequence[Any], float], list[Any]]


def gloo_world(world: int, fn: Callable[..., Any], args: Sequence[Any], timeout: float) -> list[Any]:
    """``fn(*args)`` on every rank of a CPU gloo world of ``world`` processes; results by rank."""
    from scripts.harness.worlds import QUIET, run_on_world

    return run_on_world(world, fn, *args, timeout=timeout, start_timeout=600, env=QUIET)


def _plain(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """A body of :func:`scripts.gpu.world.run_world` that calls ``fn(*args)`` (the default group is made)."""
    return fn(*args)


def gpu_world(
    world: int, fn: Callable[..., Any], args: Sequence[Any], timeout: float, backend: str = "nccl"
) -> list[Any]:
    """``fn(*args)`` on every rank of the one-GPU NCCL world (:func:`scripts.gpu.world.run_world`:
    each rank its own ``NCCL_HOSTID``, a default group bound to ``cuda:0``); results by rank.
    ``backend="gloo"``: the same launcher on CPU processes (its dry run).
    """
    from scripts.gpu.world import run_world

    return run_world(world, _plain, (fn, *args), backend=backend, mode="bound", timeout=timeout)


LAUNCHERS: dict[str, Launcher] = {"gloo": gloo_world, "gpu": gpu_world}


def run_world(launcher: Launcher, world: int, layout: str, cases: list[tuple[str, str]], rounds: int, store: str):
    """All records of every case on one world (one launch; cases interleaved by round)."""
    return launcher(world, rank_rounds, (layout, cases, rounds, store), 1800.0)


def rank_rounds(layout: str, cases: list[tuple[str, str]], rounds: int, store: str) -> list[dict]:
    """On every rank: ``rounds`` rounds, each case once per round, the order rotating."""
    out = []
    for index in range(rounds):
        order = cases[index % len(cases) :] + cases[: index % len(cases)]
        for impl, path in order:
            for record in rank_init_phases(impl, layout, store, path, 1):
                record["round"] = index
                out.append(record)
    return out


def slowest_phases(records: list[dict]) -> dict[str, float]:
    """Per phase: the median over rounds of the slowest rank's seconds; calls per rank."""
    rounds = sorted({r["round"] for r in records})
    out: dict[str, float] = {}
    for phase in PHASES:
        per_round = []
        for index in rounds:
            mine = [r for r in records if r["round"] == index]
            per_round.append(max(_phase(r, phase) for r in mine))
        out[phase] = statistics.median(per_round)
    out["calls"] = statistics.median(r["new_group_calls"] + r["split_calls"] for r in records)
    if out["calls"] and records[0]["path"] == "split":
        out["calls"] = statistics.median(r["split_calls"] for r in records)
    return out


def _phase(r: dict, phase: str) -> float:
    if phase == "create_s":
        # the stand-in's split calls new_group inside: do not count it twice
        return r["split_s"] if r["split_calls"] else r["new_group_s"]
    if phase == "protocol_store_s":
        return sum(r["init_traffic"].get(c, {}).get("seconds", 0.0) for c in ("agreement", "arrival", "closing"))
    return float(r[phase])


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``a + b * W`` through ``{W: value}`` (two or more sizes)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - b * mx, b


def model(by_world: dict[int, dict[str, float]], impl: str) -> dict[int, dict[str, float]]:
    """Each phase at :data:`MODEL_WORLDS` from the fitted lines (creation: calls x per-call cost)."""
    out: dict[int, dict[str, float]] = {w: {} for w in MODEL_WORLDS}
    worlds = sorted(by_world)
    for phase in ("agreement_s", "closing_s", "protocol_store_s", "first_use_s"):
        a, b = fit({w: by_world[w][phase] for w in worlds})
        for w in MODEL_WORLDS:
            out[w][phase] = max(a + b * w, 0.0)
    ca, cb = fit({w: by_world[w]["calls"] for w in worlds})
    pa, pb = fit({w: by_world[w]["create_s"] / max(by_world[w]["calls"], 1) for w in worlds})
    for w in MODEL_WORLDS:
        calls = max(ca + cb * w, 0.0) if impl == "mcore" else by_world[worlds[-1]]["calls"]
        out[w]["calls"] = calls
        out[w]["create_s"] = calls * max(pa + pb * w, 0.0)
        out[w]["total_s"] = sum(out[w][p] for p in ("agreement_s", "closing_s", "create_s", "first_use_s"))
    return out


def report(results: dict[int, list[dict]]) -> dict[str, Any]:
    """Print the phase table per world and the model; return both."""
    table: dict[str, dict[int, dict[str, float]]] = {}
    for world, records in sorted(results.items()):
        for key in sorted({(r["impl"], r["path"]) for r in records}):
            mine = [r for r in records if (r["impl"], r["path"]) == key]
            table.setdefault(f"{key[0]}/{key[1]}", {})[world] = slowest_phases(mine)
    head = f"{'impl/path':<15} {'W':>6} {'calls':>6} " + " ".join(f"{p[:-2]:>14}" for p in PHASES)
    print(head)
    print("-" * len(head))
    for name, by_world in table.items():
        for world, row in sorted(by_world.items()):
            cells = " ".join(f"{row[p]:14.4f}" for p in PHASES)
            print(f"{name:<15} {world:>6} {row['calls']:>6.0f} {cells}")
    models = {}
    if all(len(v) >= 2 for v in table.values()):
        print("\nscale model (fitted a + b*W per phase; creation = calls(W) x seconds per call(W)):")
        for name, by_world in table.items():
            models[name] = model(by_world, name.split("/")[0])
            for world, row in models[name].items():
                cells = " ".join(f"{row.get(p, 0.0):14.3f}" for p in PHASES)
                print(f"{name:<15} {world:>6} {row['calls']:>6.0f} {cells}")
    return {"table": table, "model": models}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, measure and print; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default="gloo")
    p.add_argument("--worlds", default="4,8", help="comma-separated world sizes (two or more for the model)")
    p.add_argument("--layout", default="tp2-pp2", help="e.g. tp2-pp2-ep2, tp2-cp2")
    p.add_argument("--cases", default="compat:member,compat:split,mcore:member", help="impl:path,...")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--store", default="launcher", help="launcher, file or tcp")
    p.add_argument("--json", help="write the records, table and model here")
    a = p.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",") if c]
    started, load = time.time(), os.getloadavg()[0]
    print(f"time to usable groups by phase, slowest rank, seconds ({a.launcher}, {a.layout}); load {load:.1f}")
    results = {
        w: [r for rank in run_world(LAUNCHERS[a.launcher], w, a.layout, cases, a.rounds, a.store) for r in rank]
        for w in (int(x) for x in a.worlds.split(","))
    }
    out = report(results)
    print(
        f"create = split_group calls (split path) or new_group calls; protocol_store = seconds in the agreement, "
        f"arrival and closing keys; first_use = one all-reduce on every distinct group; total = init + first use; "
        f"load after {os.getloadavg()[0]:.1f}; took {time.time() - started:.0f} s"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"records": {str(k): v for k, v in results.items()}, **out}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "phases")
