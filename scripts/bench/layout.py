"""Layout enumeration: parallel_state_ng's Layout vs Megatron-Core's RankGenerator and HyperCommGrid.

The nine token combinations MCore's ``initialize_model_parallel`` asks its decoder
``RankGenerator`` for (tp 8, cp 2, pp 4; dp = world / 64), timed per world size and side (median
over repeats) and compared with each other untimed: a mismatch exits with 1. Sides and figures:
docs/results/performance.md (layout enumeration); options: ``--help``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from scripts.harness.header import platform_header

TP, CP, PP = 8, 2, 4
ORDER = "tp-cp-ep-dp-pp"
TOKENS = ["dp-cp", "dp", "cp", "tp-pp", "tp", "pp", "tp-dp-cp", "tp-dp", "tp-cp"]
RANK_GENERATOR_FULL_ONLY_ABOVE = 65536

SIDES = [
    ("rank_generator", "RankGenerator.get_ranks (megatron)"),
    ("megatron_grid", "HyperCommGrid.get_rank_enum (megatron)"),
    ("grid_lists", "HyperCommGrid.get_rank_enum (ours)"),
    ("layout_tensor", "Layout.enumerate_groups (ours, tensor)"),
    ("layout_lists", "Layout.rank_enum (ours, lists)"),
    ("layout_one_rank", "Layout.group_ranks (ours, one rank)"),
]


def _time(fn: Callable[[], Any], repeats: int, *, pause_gc: bool) -> tuple[float, Any]:
    """Median wall time of ``fn()`` over ``repeats`` runs, and the last result.

    Garbage is collected once before the runs. The collector stays on while timing (as in
    real use: building millions of ints and lists triggers it) unless ``pause_gc``.
    """
    times, result = [], None
    gc.collect()
    if pause_gc:
        gc.disable()
    try:
        for _ in range(repeats):
            result = None
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times), result


def bench_world(world: int, *, full: bool, repeats: int, pause_gc: bool = False) -> dict[str, Any]:
    """Time every side for one world size and check that the enumerations agree.

    Sides: ``RankGenerator.get_ranks`` (megatron-core's pure-Python generator),
    ``HyperCommGrid.get_rank_enum`` (megatron-core's numpy enumeration), and ours:
    ``HyperCommGrid.get_rank_enum`` (the same nested lists, from a tensor),
    ``Layout.enumerate_groups`` (an int64 tensor of shape (groups, group size)),
    ``Layout.rank_enum`` (nested lists, what megatron returns) and ``Layout.group_ranks`` (only
    one rank's nine groups, what ``create_pg`` needs). Times are wall clock.
    """
    from megatron.core.hyper_comm_grid import HyperCommGrid as MegatronGrid
    from megatron.core.parallel_state import RankGenerator

    from parallel_state_ng import HyperCommGrid, Layout

    dp = world // (TP * CP * PP)
    sizes = {"tp": TP, "cp": CP, "dp": dp, "pp": PP}
    names = ["tp", "cp", "dp", "pp"]
    os.environ["WORLD_SIZE"] = str(world)
    generator = RankGenerator(tp=TP, ep=1, dp=dp, pp=PP, cp=CP, order=ORDER)
    megatron_grid = MegatronGrid([sizes[n] for n in names], names)
    layout = Layout([sizes[n] for n in names], names)
    grid = HyperCommGrid([sizes[n] for n in names], names)
    run_generator = full or world <= RANK_GENERATOR_FULL_ONLY_ABOVE
    one_rank = world // 2 + 3

    def dims(token: str) -> list[str]:
        return token.split("-")

    def megatron_arg(token: str):
        return token if "-" not in token else dims(token)

    per_token: dict[str, dict[str, float]] = {key: {} for key, _ in SIDES}
    mismatches: list[str] = []
    import torch

    def same(lists: list[list[int]], reference: torch.Tensor) -> bool:
        return torch.equal(torch.tensor(lists, dtype=torch.int64), reference)

    for token in TOKENS:
        # The reference stays a tensor: a nested list of a million ints alive meanwhile would
        # make the collector slower for the sides timed after it.
        seconds, reference = _time(lambda token=token: layout.enumerate_groups(dims(token)), repeats, pause_gc=pause_gc)
        per_token["layout_tensor"][token] = seconds
        seconds, lists = _time(lambda token=token: layout.rank_enum(dims(token)), repeats, pause_gc=pause_gc)
        per_token["layout_lists"][token] = seconds
        if not same(lists, reference):
            mismatches.append(f"{token}: Layout.rank_enum != Layout.enumerate_groups")
        del lists
        seconds, row = _time(lambda token=token: layout.group_ranks(one_rank, dims(token)), repeats, pause_gc=pause_gc)
        per_token["layout_one_rank"][token] = seconds
        if row != reference[layout.group_index(one_rank, dims(token))].tolist():
            mismatches.append(f"{token}: Layout.group_ranks({one_rank}) is not its row")
        seconds, theirs = _time(
            lambda token=token: megatron_grid.get_rank_enum(megatron_arg(token)), repeats, pause_gc=pause_gc
        )
        per_token["megatron_grid"][token] = seconds
        if not same(theirs, reference):
            mismatches.append(f"{token}: megatron HyperCommGrid.get_rank_enum differs from Layout")
        del theirs
        seconds, ours = _time(lambda token=token: grid.get_rank_enum(megatron_arg(token)), repeats, pause_gc=pause_gc)
        per_token["grid_lists"][token] = seconds
        if not same(ours, reference):
            mismatches.append(f"{token}: HyperCommGrid.get_rank_enum differs from Layout")
        del ours
        if run_generator:
            generator_repeats = repeats if world <= 4096 else 1
            seconds, theirs = _time(
                lambda token=token: generator.get_ranks(token), generator_repeats, pause_gc=pause_gc
            )
            per_token["rank_generator"][token] = seconds
            if not same(theirs, reference):
                mismatches.append(f"{token}: megatron RankGenerator.get_ranks differs from Layout")
            del theirs
        del reference
    totals = {key: (sum(v.values()) if v else None) for key, v in per_token.items()}
    return {
        "world": world,
        "sizes": sizes,
        "one_rank": one_rank,
        "rank_generator_run": run_generator,
        "seconds_total": totals,
        "seconds_per_token": per_token,
        "mismatches": mismatches,
    }


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "skipped"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def format_table(results: list[dict[str, Any]]) -> str:
    """The printed table: one row per world and side, times for all nine tokens."""
    header = f"{'world':>10}  {'side':<42} {'9 tokens':>10}  {'RankGenerator/this':>18}  {'megatron grid/this':>18}"
    lines = [header, "-" * len(header)]
    for result in results:
        totals = result["seconds_total"]
        for i, (key, label) in enumerate(SIDES):
            seconds = totals[key]
            ratios = []
            for base in ("rank_generator", "megatron_grid"):
                if seconds is None or totals[base] is None or key == base:
                    ratios.append("")
                else:
                    ratio = totals[base] / seconds if seconds > 0 else float("inf")
                    ratios.append(f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x")
            world = f"{result['world']:,}" if i == 0 else ""
            lines.append(
                f"{world:>10}  {label:<42} {_format_seconds(seconds):>10}  {ratios[0]:>18}  {ratios[1]:>18}".rstrip()
            )
        agreed = (
            "all enumerations agree" if not result["mismatches"] else "MISMATCH: " + "; ".join(result["mismatches"])
        )
        skipped = "" if result["rank_generator_run"] else " (RankGenerator skipped: run with --full, ~33 s)"
        lines.append(f"{'':>10}  {agreed}{skipped}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the benchmark and print its table; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4096,65536,1048576", help="comma-separated world sizes (multiples of 64)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per token (median); RankGenerator above 4,096 ranks: 1"
    )
    parser.add_argument(
        "--full", action="store_true", help=f"run RankGenerator above {RANK_GENERATOR_FULL_ONLY_ABOVE:,} ranks too"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: numpy and RankGenerator use one thread too; on a busy "
        "machine extra threads mostly add synchronization)",
    )
    parser.add_argument(
        "--pause-gc",
        action="store_true",
        help="pause Python's garbage collector while timing (the list-building sides get much faster)",
    )
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w.replace("_", "")) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds must be comma-separated integers, got {args.worlds!r}")
    bad = [w for w in worlds if w < TP * CP * PP or w % (TP * CP * PP)]
    if bad:
        parser.error(f"--worlds {bad}: each world size must be a positive multiple of tp*cp*pp = {TP * CP * PP}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")

    import megatron.core
    import torch

    torch.set_num_threads(args.threads)

    print(
        f"layout enumeration, tp {TP} cp {CP} pp {PP} (order {ORDER}), tokens {', '.join(TOKENS)}; "
        f"median of {args.repeats}, garbage collector {'paused' if args.pause_gc else 'on'}; "
        f"{platform_header()}; {torch.get_num_threads()} intra-op thread(s)",
        flush=True,
    )
    results = []
    for world in worlds:
        results.append(bench_world(world, full=args.full, repeats=args.repeats, pause_gc=args.pause_gc))
    print(format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "config": {"tp": TP, "cp": CP, "pp": PP, "order": ORDER, "tokens": TOKENS},
                    "repeats": args.repeats,
                    "full": args.full,
                    "pause_gc": args.pause_gc,
                    "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "megatron_core": getattr(megatron.core, "__version__", None),
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "results": results,
                },
                fh,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 1 if any(r["mismatches"] for r in results) else 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "layout")
