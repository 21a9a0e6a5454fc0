"""The scale ladder on one GPU: MCore against compat at growing world sizes, and a projection.

:func:`ladder_section` runs :func:`scripts.gpu.world_usable.usable_groups` (MCore's then compat's
``initialize_model_parallel`` at tp2 pp2 ep2 (tp1 at 4 ranks, the dry run), then one
all-reduce per getter's group) in one world per size, in order (8, 16, 32, 48, 64 ranks by
default), within one time limit. Before each size it predicts the world's time and device memory from the last size
(:func:`does_not_fit`) and stops cleanly when either would not fit; a world that fails (out of
memory, "unhandled cuda error", past the limit) also stops the ladder, reported, not raised.

Per size: time to usable groups (slowest rank), creation calls per rank, device memory
(rank 0, every rank's communicators) and rank 0's NCCL per-split init timings. From two or more
sizes (:func:`projection`), with :func:`scripts.bench.phases.fit`: creation calls per rank and
seconds per creation call, each ``a + b * W``; MCore's creation at 1,024 and 65,536 ranks is
calls(W) x cost(W) (every group of the world on every rank, each a world-wide split on a bound
device), compat's its last measured calls x cost(W). The NCCL per-split median is fitted the
same way. A benchmark: its figures are reported, never asserted.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from scripts.bench.phases import MODEL_WORLDS, fit
from scripts.gpu.world import WorldError, run_world
from scripts.gpu.world_usable import Case, nccl_log_env, summary, summary_text, usable_groups, usable_sizes

CASES: list[Case] = [("MCore", "mcore", {}), ("compat", "compat", {})]
#: Device memory a world may be predicted to use, as a share of the device's.
MEMORY_SHARE = 0.92
Check = tuple[str, bool, str]


def does_not_fit(
    size: int, done: list[tuple[int, float, int | None]], left_s: float, total_mib: int | None
) -> str | None:
    """Why a world of ``size`` ranks is not started (``None``: start it).

    ``done``: ``(size, wall seconds, device MiB in use at the peak)`` of the sizes run, in order;
    ``left_s``: the ladder's time left. The next world is predicted from the last one: time
    grows as (size ratio)^k, k the growth measured between the last two sizes (within 1 and 2),
    else 1.5 (more processes to start on the same cores, more creation calls, wider splits);
    memory as the size ratio times the last per-rank growth (at least 1). A world predicted to
    fit may still run past the time left: it is then stopped at that limit, within the ladder's.
    """
    if left_s <= 0:
        return "no time left"
    if not done:
        return None
    last_size, last_s, last_mib = done[-1]
    ratio = size / last_size
    power = 1.5
    if len(done) > 1 and done[-2][1] > 0 and done[-2][0] != last_size:
        power = min(2.0, max(1.0, math.log(last_s / done[-2][1]) / math.log(last_size / done[-2][0])))
    predicted_s = last_s * ratio**power
    if predicted_s > left_s:
        return f"predicted {predicted_s:.0f} s (from {last_s:.0f} s at {last_size} ranks), {left_s:.0f} s left"
    if last_mib is not None and total_mib:
        growth = 1.0
        if len(done) > 1 and done[-2][2]:
            prev_size, _, prev_mib = done[-2]
            growth = max(1.0, (last_mib / last_size) / (prev_mib / prev_size))  # type: ignore[operator]
        predicted_mib = last_mib * ratio * growth
        if predicted_mib > MEMORY_SHARE * total_mib:
            return (
                f"predicted {predicted_mib:.0f} MiB of device memory (from {last_mib} MiB at {last_size} ranks), "
                f"over {MEMORY_SHARE:.0%} of {total_mib} MiB"
            )
    return None


def _rising(points: dict[int, float]) -> tuple[float, float]:
    """:func:`fit`'s line, flat at the mean where it falls (a cost does not shrink with the world:
    a falling fit is noise, and extrapolated it would go below zero).
    """
    a, b = fit(points)
    return (a, b) if b >= 0 else (sum(points.values()) / len(points), 0.0)


def projection(by_size: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per implementation, at :data:`~scripts.bench.phases.MODEL_WORLDS`: ``calls``, ``per_call_s``
    and ``create_s`` (calls x seconds per call), and ``nccl_split_s`` where NCCL's timings exist.
    Costs are fitted with :func:`_rising` (flat where the fit falls).

    ``by_size``: size -> label -> :func:`scripts.gpu.world_usable.summary` (two sizes or more).
    """
    sizes = sorted(by_size)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for label in by_size[sizes[0]]:
        rows = {w: by_size[w][label] for w in sizes if label in by_size[w]}
        ca, cb = fit({w: float(r["calls"]) for w, r in rows.items()})
        pa, pb = _rising({w: r["init_s"] / max(r["calls"], 1) for w, r in rows.items()})
        nccl = {w: r["nccl_split_s"] for w, r in rows.items() if r.get("nccl_split_s") is not None}
        na, nb = _rising(nccl) if len(nccl) > 1 else (0.0, 0.0)
        grows = label.lower().startswith("mcore")
        out[label] = {}
        for w in MODEL_WORLDS:
            calls = max(ca + cb * w, 0.0) if grows else float(rows[max(rows)]["calls"])
            per_call = max(pa + pb * w, 0.0)
            out[label][w] = {"calls": calls, "per_call_s": per_call, "create_s": calls * per_call}
            if len(nccl) > 1:
                out[label][w]["nccl_split_s"] = max(na + nb * w, 0.0)
    return out


def projection_lines(model: dict[str, dict[int, dict[str, float]]]) -> list[str]:
    """The projection as report lines."""
    lines = ["projection (fitted a + b*W; creation = calls(W) x seconds per call(W)):"]
    for label, worlds in model.items():
        for w, row in worlds.items():
            nccl = f", NCCL per split {row['nccl_split_s']:.3f} s" if "nccl_split_s" in row else ""
            lines.append(
                f"  {label} at {w:,} ranks: {row['calls']:,.0f} calls x {row['per_call_s']:.4f} s = "
                f"{row['create_s']:,.1f} s{nccl}"
            )
    return lines


def _mib(value: int | None) -> str:
    return "- (no device)" if value is None else f"{value} MiB"


def ladder_section(
    sizes: tuple[int, ...], backend: str, mode: str, limit_s: float, tag: str, failure: Callable[[WorldError], str]
) -> tuple[list[str], list[Check]]:
    """Run the ladder (module docstring); report lines and ``(check, passed, detail)`` rows.

    ``failure``: a failed world's summary for the report (``world_report._failure_summary``).
    """
    start = time.monotonic()
    lines = [
        f"{tag} ladder: sizes {list(sizes)}, tp2 pp2 ep2 (4 ranks: tp1), MCore then compat in each world, "
        f"{limit_s:.0f} s in all"
    ]
    rows: list[Check] = []
    done: list[tuple[int, float, int | None]] = []
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    total_mib: int | None = None
    stopped = "every size ran"
    for size in sizes:
        left = limit_s - (time.monotonic() - start)
        why = does_not_fit(size, done, left, total_mib)
        if why:
            stopped = f"stopped before {size} ranks: {why}"
            break
        logs = tempfile.mkdtemp(prefix="psng-ladder-")
        began = time.monotonic()
        env = {**nccl_log_env(logs)} if backend == "nccl" else {}
        try:
            results = run_world(
                size, usable_groups, (usable_sizes(size), CASES), backend=backend, mode=mode, timeout=left, env=env
            )
        except WorldError as err:
            stopped = f"stopped at {size} ranks, which did not fit: {failure(err)}"
            break
        finally:
            shutil.rmtree(logs, ignore_errors=True)
        wall = time.monotonic() - began
        total_mib = results[0]["total_mib"]
        by_size[size] = {label: summary(results, label) for label, _, _ in CASES}
        peak = [s["used_mib"] for s in by_size[size].values() if s["used_mib"] is not None]
        done.append((size, wall, max(peak) if peak else None))
        lines.append(f"{size} ranks ({wall:.1f} s world):")
        lines += [f"  {summary_text(label, s)}" for label, s in by_size[size].items()]
        ok = all(s["ok"] for s in by_size[size].values())
        mine = by_size[size]["compat"]
        theirs = by_size[size]["MCore"]
        rows.append(
            (
                f"{tag} ladder {size} ranks: every getter's group all-reduced, MCore and compat",
                ok,
                f"usable MCore {theirs['usable_s']:.2f} s, compat {mine['usable_s']:.2f} s; calls per rank "
                f"MCore {theirs['calls']}, compat {mine['calls']}; groups hold MCore {_mib(theirs['held_mib'])}, "
                f"compat {_mib(mine['held_mib'])}",
            )
        )
    lines.append(f"ladder {stopped} ({time.monotonic() - start:.0f} s)")
    rows.append((f"{tag} ladder: {stopped}", bool(by_size), f"sizes run {sorted(by_size)}"))
    if len(by_size) > 1:
        lines += projection_lines(projection(by_size))
    else:
        lines.append("projection: needs two sizes or more")
    return lines, rows
