"""Sleep and wake on one GPU (issue 51): device memory awake, asleep and awake again; times; training after wake.

:func:`sleep_section` runs one world (8 ranks on the GPU, the mode given: bound or lazy) whose
ranks do :func:`sleep_measure`:

1. compat's ``initialize_model_parallel`` at tp2 pp2 ep2 (tp1 at 4 ranks, the dry run) and one
   all-reduce on each getter's group (a lazy NCCL group makes its communicator then);
2. the device's free memory (``torch.cuda.mem_get_info``, rank 0 between barriers: every
   rank's communicators) and this rank's backends' ``memory_stats()`` summed per key, where a
   backend reports them: awake, after ``compat.parallel_state.sleep_model_parallel()`` and after
   ``wake_model_parallel()`` (then every getter's group all-reduced again);
3. the mechanism per group from the sleep report: ``native`` (``Backend.suspend()``: NCCL 2.29.7
   or later through torch) is measured where it ran, otherwise its row says why not (the reason
   the report gives and the NCCL version); ``fenced`` is the fallback (nothing freed: torch
   cannot release a backend behind the same ``ProcessGroup``), whose memory the figures show;
4. the seconds of the sleep and of the wake (each with its agreement round; slowest rank);
5. the tiny GPT (dense, tp2 pp2) under compat for 2 steps with every communicator asleep and
   awake again after each step, against the same 2 steps without: the step after the wake must
   be bit-identical (losses, gradient norms, every rank's digest).

On gloo (the CPU dry run) the same code runs with CPU tensors; device memory is "not measured".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scripts.gpu import world_training
from scripts.gpu.world import RankContext, WorldError, run_world
from scripts.gpu.world_usable import _free_mib, _touch, usable_sizes

Check = tuple[str, bool, str]
#: The training runs compared: with sleep and wake after each step, and without.
TRAINING_STEPS = 2


def _backend_stats(device: Any) -> dict[str, int] | None:
    """This rank's groups' ``memory_stats()`` summed per key (``None``: no backend reports them)."""
    from parallel_state_ng.groups.creation import live_groups

    total: dict[str, int] | None = None
    for group in live_groups():
        try:
            stats = group._get_backend(device).memory_stats()
        except (AttributeError, RuntimeError, ValueError):  # gloo: "does not support"; no backend there
            continue
        total = total or {}
        for key, value in stats.items():
            total[key] = total.get(key, 0) + int(value)
    return total


def _nccl_version() -> str:
    import torch

    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - no NCCL in this torch (the CPU build)
        return "none"


def _training(ctx: RankContext) -> dict[str, Any]:
    """The dense tiny GPT under compat, without and with sleep/wake after each step."""
    import torch

    from scripts.examples.gpt.training import parallel_state_impl, run_once

    device = "cpu"
    if ctx.backend == "nccl":
        device = str(ctx.device)
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = next(iter(world_training.training_layouts(ctx.world_size, ("dense",), TRAINING_STEPS).values()))
    out = {}
    for label, sleep_wake in (("plain", False), ("sleep", True)):
        with parallel_state_impl("compat", "after"):
            out[label] = run_once(cfg.replace(impl="compat", install="after", sleep_wake=sleep_wake), device=device)
    return {k: {f: v[f] for f in world_training.FIELDS} for k, v in out.items()}


def sleep_measure(ctx: RankContext) -> dict[str, Any]:
    """This rank's figures (module docstring)."""
    import importlib

    from scripts.gpu.world_checks import _prepare

    _prepare(ctx)
    ps: Any = importlib.import_module("compat.parallel_state")
    ps.initialize_model_parallel(**usable_sizes(ctx.world_size))
    touched, right = _touch(ps, ctx.device)
    out: dict[str, Any] = {"rank": ctx.rank, "touched": touched, "nccl": _nccl_version()}
    out["free_mib"] = {"awake": _free_mib(ctx)}
    out["stats"] = {"awake": _backend_stats(ctx.device)}
    start = time.perf_counter()
    report = ps.sleep_model_parallel(timeout=60)
    out["sleep_s"] = round(time.perf_counter() - start, 4)
    out["free_mib"]["asleep"] = _free_mib(ctx)
    out["stats"]["asleep"] = _backend_stats(ctx.device)
    start = time.perf_counter()
    ps.wake_model_parallel(timeout=60)
    out["wake_s"] = round(time.perf_counter() - start, 4)
    touched_again, right_again = _touch(ps, ctx.device)
    out["free_mib"]["woken"] = _free_mib(ctx)
    out["stats"]["woken"] = _backend_stats(ctx.device)
    out["sums_ok"] = right and right_again and touched_again == touched
    out["mechanisms"] = {m: len(report.by_mechanism(m)) for m in sorted({g.mechanism for g in report.groups})}
    freed = [g.bytes_freed for g in report.groups if g.bytes_freed is not None]
    out["bytes_freed"] = sum(freed) if freed else None
    out["fenced_reason"] = next((g.reason for g in report.by_mechanism("fenced")), "")
    ps.destroy_model_parallel()
    out["training"] = _training(ctx)
    return out


def _mib(value: int | None) -> str:
    return "not measured (no device)" if value is None else f"{value} MiB free"


def sleep_rows(tag: str, results: list[dict[str, Any]]) -> tuple[list[str], list[Check]]:
    """Report lines and ``(check, passed, detail)`` rows from the ranks' :func:`sleep_measure`."""
    r0 = results[0]
    free, stats = r0["free_mib"], r0["stats"]
    sleep_s, wake_s = max(r["sleep_s"] for r in results), max(r["wake_s"] for r in results)
    native = sum(r["mechanisms"].get("native", 0) + r["mechanisms"].get("mixed", 0) for r in results)
    fenced = sum(r["mechanisms"].get("fenced", 0) for r in results)
    lines = [
        f"  device memory (rank 0, every rank's groups): awake {_mib(free['awake'])}, asleep {_mib(free['asleep'])}, "
        f"awake again {_mib(free['woken'])}",
        f"  rank 0's backends' memory_stats(): awake {stats['awake'] or 'not reported'}, asleep "
        f"{stats['asleep'] or 'not reported'}, awake again {stats['woken'] or 'not reported'}",
        f"  mechanisms (rank 0): {r0['mechanisms']}; bytes freed (rank 0, as reported): {r0['bytes_freed']}; "
        f"sleep {sleep_s:.4f} s, wake {wake_s:.4f} s (slowest rank, each with its agreement round); NCCL {r0['nccl']}",
    ]
    rows: list[Check] = [
        (
            f"{tag} sleep: every getter's group all-reduced before and after the sleep",
            all(r["sums_ok"] for r in results),
            f"{r0['touched']} groups per rank; sleep {sleep_s:.4f} s, wake {wake_s:.4f} s",
        ),
        (
            f"{tag} sleep: the fallback (fenced) groups",
            True,
            f"{fenced} groups over the ranks; memory {_mib(free['awake'])} -> {_mib(free['asleep'])} -> "
            f"{_mib(free['woken'])}" + ("" if fenced else " (none: every backend suspended natively)"),
        ),
    ]
    if native:
        rows.append(
            (
                f"{tag} sleep: native suspend (Backend.suspend)",
                True,
                f"{native} groups over the ranks; bytes freed on rank 0: {r0['bytes_freed']}",
            )
        )
    else:
        why = r0["fenced_reason"] or "no group was put to sleep"
        lines.append(f"  native suspend: skipped: NCCL {r0['nccl']}; {why}")
    differ = [
        (r["rank"], f)
        for r in results
        for f in world_training.FIELDS
        if r["training"]["plain"][f] != r["training"]["sleep"][f]
    ]
    losses = next((r["training"]["sleep"]["losses"] for r in results if r["training"]["sleep"]["losses"]), None)
    rows.append(
        (
            f"{tag} sleep: the step after wake bit-identical to a run without sleep",
            not differ and bool(losses),
            f"{TRAINING_STEPS} steps, sleep/wake after each; losses {losses}; "
            f"differs (rank, field): {differ[:6] or 'none'}",
        )
    )
    return lines, rows


def sleep_section(
    size: int, backend: str, mode: str, timeout: float, tag: str, failure: Callable[[WorldError], str]
) -> tuple[list[str], list[Check]]:
    """Run the sleep world (module docstring); report lines and ``(check, passed, detail)`` rows."""
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if backend == "nccl" else {}
    lines = [f"{tag} sleep: compat at {usable_sizes(size)}, sleep_model_parallel / wake_model_parallel"]
    try:
        results = run_world(size, sleep_measure, (), backend=backend, mode=mode, timeout=timeout, env=env)
    except WorldError as err:
        return [*lines, f"FAILED {tag} sleep: {err}"[:6000]], [(f"{tag} sleep: the world", False, failure(err))]
    more, rows = sleep_rows(tag, results)
    return lines + more, rows
