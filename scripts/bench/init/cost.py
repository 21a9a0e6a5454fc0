"""Per-rank cost of ``initialize_model_parallel``: Megatron-Core vs ``compat`` vs the floor.

One simulated rank (torch's fake backend) at several world sizes, each side in its own
subprocesses: median init time, ``new_group`` calls, peak memory, import time, and a check that
MCore and compat hand out the same groups. Measurement probes: :mod:`scripts.bench.init.probes`.
Method, sides and figures: docs/results/performance.md (per-rank cost); options: ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from scripts.bench.init.probes import (
    GETTERS,  # noqa: F401 (re-exported)
    NewGroupCounter,
    getter_digests,
    module_state_names,
    peak_bytes,
    reset_peak,
    rss_bytes,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG: dict[str, int] = {
    "tensor_model_parallel_size": 8,
    "pipeline_model_parallel_size": 4,
    "context_parallel_size": 2,
    "expert_model_parallel_size": 8,
}
MARK = "BENCH_JSON "
MB = 1024 * 1024


# ----------------------------------------------------------------------------- worker
def _rank_of(spec: str, world: int) -> int:
    if spec == "mid":
        return world // 2 + 3
    if spec == "last":
        return world - 1
    rank = int(spec)
    if not 0 <= rank < world:
        raise SystemExit(f"--ranks entry {spec!r} is outside 0..{world - 1}")
    return rank


def _expected_groups(world: int, rank: int) -> tuple[list[str], list[list[int]]]:
    """Kinds the rank belongs to and their rank lists, from MegatronLayout."""
    from parallel_state_ng.layout.megatron_layout import MegatronLayout

    layout = MegatronLayout(world_size=world, **CONFIG)
    kinds, lists = [], []
    for kind in layout.kinds():
        ranks = layout.group(kind, rank)
        if ranks is not None:
            kinds.append(kind)
            lists.append(ranks)
    return kinds, lists


def _worker(side: str, world: int, rank: int, repeats: int) -> dict[str, Any]:
    import gc

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if side == "mcore":
        import megatron.core.parallel_state as mod
    elif side == "compat":
        import compat.parallel_state as mod
    elif side == "floor":
        mod = None
    else:
        raise SystemExit(f"--worker must be mcore, compat or floor, got {side!r}")

    import parallel_state_ng.layout.megatron_layout  # noqa: F401  (imported before measuring the lists)

    gc.collect()
    rss0 = rss_bytes()
    kinds, lists = _expected_groups(world, rank)
    lists_bytes = rss_bytes() - rss0  # what the floor gets for free: the rank lists and their ints
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    world_pg = dist.distributed_c10d._get_default_group()
    pg_map = dist.distributed_c10d._world.pg_map
    counter = NewGroupCounter(dist)
    initial = module_state_names(mod) if mod is not None else {}

    def init() -> Any:
        if side == "floor":
            return [dist.new_group(r, use_local_synchronization=True) for r in lists]
        mod.initialize_model_parallel(create_gloo_process_groups=False, **CONFIG)
        return None

    times, peaks, calls, local = [], [], [], []
    digests: dict[str, str] = {}
    leftovers: dict[str, Any] = {}
    can_reset = reset_peak()
    for i in range(repeats):
        gc.collect()
        counter.reset()
        before = rss_bytes()
        reset_peak()
        t0 = time.perf_counter()
        made = init()
        elapsed = time.perf_counter() - t0
        peaks.append(peak_bytes() - before)
        times.append(elapsed)
        calls.append(counter.calls)
        local.append(counter.local_sync)
        if i == 0 and mod is not None:
            digests = getter_digests(dist, mod)
        # ---- tear down
        if side == "floor":
            for pg in made:
                dist.destroy_process_group(pg)
            continue
        mod.destroy_model_parallel()
        stale_groups = [pg for pg in list(pg_map) if pg is not world_pg]
        stale_globals = sorted(k for k, v in initial.items() if getattr(mod, k) is not None and getattr(mod, k) != v)
        if i == 0:
            leftovers = {"groups_left": len(stale_groups), "globals_left": stale_globals}
        for pg in stale_groups:
            dist.destroy_process_group(pg)
        for k, v in initial.items():
            setattr(mod, k, {} if v == {} else v)
    dist.destroy_process_group()
    member_sets = len({tuple(sorted(r)) for r in lists})
    return {
        "side": side,
        "world": world,
        "rank": rank,
        "kinds": kinds,
        "group_sizes": [len(r) for r in lists],
        "distinct_member_sets": member_sets,
        "rank_lists_bytes": lists_bytes,
        "times_s": times,
        "median_s": statistics.median(times),
        "new_group_calls": calls,
        "local_sync_calls": local,
        "peak_bytes": peaks,
        "peak_method": "VmHWM after clear_refs reset, minus VmRSS before"
        if can_reset
        else "ru_maxrss minus VmRSS before",
        "getters": digests,
        **leftovers,
    }


def _import_worker(module: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch.distributed  # noqa: F401

    t1 = time.perf_counter()
    __import__(module)
    t2 = time.perf_counter()
    return {"module": module, "torch_distributed_s": t1 - t0, "added_s": t2 - t1}


# ----------------------------------------------------------------------------- driver
def _spawn(args: list[str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "init", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(f"worker {args} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge worker results of one side: times pooled, peak = median of each first init."""
    merged = dict(runs[0])
    merged["times_s"] = [t for r in runs for t in r["times_s"]]
    merged["median_s"] = statistics.median(merged["times_s"])
    merged["first_init_peaks"] = [r["peak_bytes"][0] for r in runs]
    merged["peak_first_init"] = int(statistics.median(merged["first_init_peaks"]))
    merged["processes"] = len(runs)
    return merged


def _measure(sides: list[str], world: int, rank: int, repeats: int, rounds: int) -> dict[str, dict[str, Any]]:
    """``rounds`` fresh worker processes per side of ``repeats`` cycles each, sides alternating
    (so a change in machine load hits all sides alike).
    """
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side in sides:
            runs[side].append(
                _spawn(["--worker", side, "--world", str(world), "--rank", str(rank), "--repeats", str(repeats)], 1800)
            )
    return {side: _merge(r) for side, r in runs.items()}


def _import_times(module: str, samples: int) -> dict[str, Any]:
    runs = [_spawn(["--import-worker", module], 300) for _ in range(samples)]
    added = [r["added_s"] for r in runs]
    return {
        "module": module,
        "added_median_s": statistics.median(added),
        "added_s": added,
        "torch_distributed_median_s": statistics.median(r["torch_distributed_s"] for r in runs),
    }


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _fmt_mb(b: int | None) -> str:
    return "—" if b is None else f"{b / MB:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "—"
    return f"{a / b:.2f}" if a / b < 10 else f"{a / b:.0f}"


def _targets(results: dict[str, Any]) -> list[str]:
    """One line per performance target: met or missed, with the figures behind it."""

    def verdict(ok: bool) -> str:
        return "met   " if ok else "MISSED"

    lines = ["targets:"]
    runs = results["runs"]
    speed = [
        (r["world"], r["mcore"]["median_s"] / r["compat"]["median_s"])
        for r in runs
        if r["mcore"] and r["world"] == 65536
    ]
    if speed:
        ok = all(x >= 100 for _, x in speed)
        lines.append(
            f"  {verdict(ok)} compat >= 100x faster than MCore at 65,536 ranks: {[round(x) for _, x in speed]}x"
        )
    else:
        lines.append("  n/a    compat >= 100x faster than MCore at 65,536 ranks (not measured)")
    t = [r["compat"]["median_s"] / r["floor"]["median_s"] for r in runs]
    m = [r["compat"]["peak_first_init"] / r["floor"]["peak_first_init"] for r in runs]
    lines.append(f"  {verdict(max(t) <= 1.5)} compat time <= 1.5x floor at every size: max {max(t):.2f}x")
    lines.append(f"  {verdict(max(m) <= 1.5)} compat peak memory <= 1.5x floor at every size: max {max(m):.2f}x")
    calls_ok = all(
        all(c == len(r["compat"]["kinds"]) for c in r["compat"]["new_group_calls"])
        and all(c == len(r["compat"]["kinds"]) for c in r["compat"]["local_sync_calls"])
        for r in runs
    )
    lines.append(
        f"  {verdict(calls_ok)} new_group calls per rank = groups of the rank, all local: "
        + ", ".join(f"{r['world']:,}/{r['rank']:,}: {r['compat']['new_group_calls'][0]}" for r in runs)
    )
    imp = [i for i in results["imports"] if i["module"] == "compat.parallel_state"]
    if imp:
        added = imp[0]["added_median_s"]
        lines.append(f"  {verdict(added < 0.1)} import compat.parallel_state adds < 0.1 s: {added:.3f} s")
    return lines


def _print(line: str, out: list[str]) -> None:
    print(line, flush=True)
    out.append(line)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the benchmark and print its table; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="4096,65536,1048576", help="comma-separated world sizes")
    p.add_argument("--ranks", default="mid,last", help="ranks to simulate: 'mid' (world//2+3), 'last', or ints")
    p.add_argument("--repeats", type=int, default=7, help="init/destroy cycles per process for compat and the floor")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes for compat and the floor (alternating)")
    p.add_argument("--mcore-repeats", type=int, default=3, help="init/destroy cycles for MCore")
    p.add_argument("--mcore-max-world", type=int, default=65536, help="skip MCore above this world size")
    p.add_argument("--import-samples", type=int, default=5, help="fresh processes per import timing")
    p.add_argument("--json", help="write all results to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--import-worker", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.import_worker:
        print(MARK + json.dumps(_import_worker(args.import_worker)), flush=True)
        return 0
    if args.worker:
        print(MARK + json.dumps(_worker(args.worker, args.world, args.rank, args.repeats)), flush=True)
        return 0

    worlds = [int(w) for w in args.worlds.split(",") if w]
    out: list[str] = []
    started = time.perf_counter()
    results: dict[str, Any] = {
        "config": {**CONFIG, "create_gloo_process_groups": False},
        "machine": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_before": os.getloadavg(),
        },
        "runs": [],
        "imports": [],
    }
    import torch

    results["machine"]["torch"] = torch.__version__

    _print(
        f"initialize_model_parallel, one simulated rank (fake backend), tp 8 pp 4 cp 2 ep 8, no gloo groups; "
        f"time: median of {args.rounds} processes x {args.repeats} cycles (MCore: 1 x {args.mcore_repeats}); "
        f"load {os.getloadavg()[0]:.2f}",
        out,
    )
    header = (
        f"{'world':>9} {'rank':>9} {'groups':>6} | {'MCore s':>8} {'calls':>7} {'MB':>7} | "
        f"{'compat s':>8} {'calls':>6} {'MB':>6} | {'floor s':>8} {'MB':>6} | "
        f"{'MCore/compat':>12} {'compat/floor t':>14} {'compat/floor mem':>16} | same groups"
    )
    _print(header, out)
    _print("-" * len(header), out)
    notes: list[str] = []
    for world in worlds:
        for spec in args.ranks.split(","):
            rank = _rank_of(spec, world)
            row: dict[str, Any] = {"world": world, "rank": rank}
            row.update(_measure(["floor", "compat"], world, rank, args.repeats, args.rounds))
            row["mcore"] = None
            if world <= args.mcore_max_world:
                row["mcore"] = _measure(["mcore"], world, rank, args.mcore_repeats, 1)["mcore"]
            results["runs"].append(row)
            fl, co, mc = row["floor"], row["compat"], row["mcore"]
            if mc is None:
                same = f"MCore skipped (world > --mcore-max-world {args.mcore_max_world})"
            else:
                diff = [k for k in mc["getters"] if mc["getters"][k] != co["getters"].get(k)]
                same = "yes" if not diff else f"NO: {diff}"
                row["same_groups"] = not diff
                if mc.get("groups_left") or mc.get("globals_left"):
                    notes.append(
                        f"world {world} rank {rank}: MCore's destroy_model_parallel left {mc['groups_left']} groups "
                        f"in torch's registry and globals {mc['globals_left']}"
                    )
            if co.get("groups_left") or co.get("globals_left"):
                notes.append(
                    f"world {world} rank {rank}: compat's destroy_model_parallel left {co['groups_left']} groups "
                    f"and globals {co['globals_left']}"
                )
            mc_s = mc["median_s"] if mc else None
            mc_calls = str(mc["new_group_calls"][0]) if mc else "—"
            mc_mb = mc["peak_first_init"] if mc else None
            _print(
                f"{world:>9,} {rank:>9,} {len(fl['kinds']):>6} | {_fmt_s(mc_s):>8} {mc_calls:>7} {_fmt_mb(mc_mb):>7} | "
                f"{_fmt_s(co['median_s']):>8} {co['new_group_calls'][0]:>6} {_fmt_mb(co['peak_first_init']):>6} | "
                f"{_fmt_s(fl['median_s']):>8} {_fmt_mb(fl['peak_first_init']):>6} | "
                f"{_ratio(mc_s, co['median_s']):>12} {_ratio(co['median_s'], fl['median_s']):>14} "
                f"{_ratio(co['peak_first_init'], fl['peak_first_init']):>16} | {same}",
                out,
            )
    _print("", out)
    _print(
        "groups: kinds of group the rank belongs to (MegatronLayout); calls: torch.distributed.new_group calls "
        "during one init; MB: peak RSS growth of a process's first init, median over processes ("
        + row["compat"]["peak_method"]
        + ").",
        out,
    )
    for row in results["runs"]:
        co = row["compat"]
        _print(
            f"  world {row['world']:,} rank {row['rank']:,}: {len(co['kinds'])} groups "
            f"({co['distinct_member_sets']} distinct member sets), sizes {co['group_sizes']}; "
            f"compat new_group calls {co['new_group_calls'][0]} ({co['local_sync_calls'][0]} with "
            f"use_local_synchronization=True); the floor's rank lists (built before its clock, not charged "
            f"to it) take {_fmt_mb(row['floor']['rank_lists_bytes'])} MB",
            out,
        )
    for note in dict.fromkeys(notes):
        _print("  " + note, out)

    _print("", out)
    for module in ("compat.parallel_state", "megatron.core.parallel_state"):
        imp = _import_times(module, args.import_samples)
        results["imports"].append(imp)
        _print(
            f"import {module}: +{imp['added_median_s']:.3f} s over import torch.distributed "
            f"(median of {args.import_samples} fresh processes; torch.distributed itself "
            f"{imp['torch_distributed_median_s']:.2f} s)",
            out,
        )
    _print("", out)
    for line in _targets(results):
        _print(line, out)
    results["machine"]["load_after"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - started
    _print(f"load average after: {os.getloadavg()[0]:.2f}; benchmark took {results['elapsed_s']:.0f} s", out)
    results["table"] = out
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "init")
