"""Time, creation calls and device memory of usable groups, per case, in an N-rank world on one GPU.

:func:`usable_groups` runs on every rank of a world of :mod:`scripts.gpu.world` (the ladder,
:mod:`scripts.gpu.world_ladder`, and the sharing policies, :mod:`scripts.gpu.world_sharing`).
For each case (MCore's ``parallel_state`` or compat's, under some environment such as
``PSNG_SHARE_GROUPS``), in the same processes one after the other:

* ``initialize_model_parallel`` with the given sizes, its ``new_group`` / ``split_group`` calls
  counted (:func:`scripts.gpu.options.recording`);
* one all-reduce on each getter's group (:data:`scripts.gpu.options.GETTERS`; a lazy NCCL group
  makes its communicator then): "time to usable groups" is init plus these, on this rank;
* the device's free memory before, with every group used and after destroy, read by rank 0
  between barriers while every rank waits (all ranks share the one device, so it counts every
  rank's communicators);
* on NCCL with :func:`nccl_log_env`, rank 0's NCCL ``Init timings`` lines written during the
  case (:func:`parse_init_timings`).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from scripts.gpu.world import RankContext

#: One case: (label, ``mcore`` or ``compat``, environment set during the case; value ``None``: unset).
Case = tuple[str, str, dict[str, str | None]]
_TIMINGS = re.compile(r"Init timings - (\w+): rank (\d+) nranks (\d+) total ([0-9.]+)")
#: The ``NCCL_DEBUG_FILE`` pattern: ``%p`` is the process id (NCCL's own placeholder).
_LOG_NAME = "nccl-%p.log"


def usable_sizes(size: int) -> dict[str, int]:
    """The layout measured: tp2 pp2 ep2 (a multiple of 8 ranks), tp1 pp2 ep2 at 4 ranks (the dry run)."""
    if size == 4:
        return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}
    if size < 8 or size % 8:
        raise ValueError(f"tp2 pp2 ep2 needs a multiple of 8 ranks (4: tp1 pp2 ep2), got {size}")
    return {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}


def nccl_log_env(directory: str) -> dict[str, str]:
    """Environment for every rank of a world: NCCL's INFO lines of its INIT subsystem, one file per process."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT", "NCCL_DEBUG_FILE": os.path.join(directory, _LOG_NAME)}


def parse_init_timings(text: str) -> list[dict[str, Any]]:
    """NCCL's ``Init timings`` lines (NCCL 2.23+) as ``{"call", "nranks", "total_s"}``, in order.

    A line reads ``... NCCL INFO Init timings - ncclCommSplit: rank 0 nranks 2 total 0.02
    (kernels 0.00, ...)``; ``call`` is the NCCL call (``ncclCommInitRankConfig``, ``ncclCommSplit``, ...).
    """
    return [
        {"call": m.group(1), "nranks": int(m.group(3)), "total_s": float(m.group(4))} for m in _TIMINGS.finditer(text)
    ]


def _log_path() -> str | None:
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    return pattern.replace("%p", str(os.getpid())) if pattern else None


def _log_size(path: str | None) -> int:
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def _log_since(path: str | None, offset: int) -> list[dict[str, Any]]:
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as stream:
        stream.seek(offset)
        return parse_init_timings(stream.read())


def _sync(device: Any) -> None:
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _free_mib(ctx: RankContext) -> int | None:
    """The device's free MiB, read on rank 0 between two barriers (``None`` elsewhere and on the CPU)."""
    import torch

    _sync(ctx.device)
    free = torch.cuda.mem_get_info()[0] // 2**20 if ctx.rank == 0 and ctx.device.type == "cuda" else None
    _sync(ctx.device)
    return free


def _touch(ps: Any, device: Any) -> tuple[int, bool]:
    """One all-reduce on each getter's group, in :data:`GETTERS` order (the same on every rank);
    (getters touched, every sum right).
    """
    import torch
    import torch.distributed as dist

    from scripts.gpu.options import GETTERS

    touched, right = 0, True
    for name in GETTERS:
        getter = getattr(ps, name, None)
        try:
            group = getter() if getter is not None else None
        except Exception:  # noqa: BLE001 - a group this release or layout leaves unset
            group = None
        if group is None:
            continue
        value = torch.ones(1, device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(value, group=group)
        right = right and float(value) == dist.get_world_size(group)
        touched += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return touched, right


def _one_case(ctx: RankContext, ps: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from parallel_state_ng.groups.split import creation_path
    from scripts.gpu.options import _leftovers, recording, registered_groups

    log = _log_path() if ctx.rank == 0 else None
    before = set(dist.distributed_c10d._world.pg_map)
    free_before = _free_mib(ctx)
    offset = _log_size(log)
    start = time.perf_counter()
    with recording(True) as calls:
        ps.initialize_model_parallel(**sizes)
    init_s = time.perf_counter() - start
    touched, right = _touch(ps, ctx.device)
    usable_s = time.perf_counter() - start
    free_used = _free_mib(ctx)
    groups = registered_groups() - len(before)
    ps.destroy_model_parallel()
    leaked = _leftovers(before)  # MCore's destroy leaves some
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    free_after = _free_mib(ctx)
    return {
        "init_s": round(init_s, 4),
        "usable_s": round(usable_s, 4),
        "new_group": sum(c["call"] == "new_group" for c in calls),
        "split_group": sum(c["call"] == "split_group" for c in calls),
        "groups": groups,
        "touched": touched,
        "sums_ok": right,
        "leaked": leaked,
        "creation_path": creation_path(),
        "free_mib": (free_before, free_used, free_after),
        "nccl": _log_since(log, offset),
    }


def usable_groups(ctx: RankContext, sizes: dict[str, Any], cases: list[Case]) -> dict[str, Any]:
    """Each case's figures on this rank (module docstring): ``rank``, ``total_mib`` (the device's,
    rank 0) and ``cases``: label -> ``init_s``, ``usable_s``, ``new_group``, ``split_group``,
    ``groups``, ``touched``, ``sums_ok``, ``leaked``, ``creation_path``, ``free_mib`` (before,
    used, after; rank 0 on CUDA) and ``nccl`` (rank 0's ``Init timings`` of the case).
    """
    import importlib

    import torch

    from scripts.gpu.world_checks import _prepare

    _prepare(ctx)
    modules = {"mcore": "megatron.core.parallel_state", "compat": "compat.parallel_state"}
    out: dict[str, Any] = {"rank": ctx.rank, "cases": {}, "total_mib": None}
    if ctx.rank == 0 and ctx.device.type == "cuda":
        out["total_mib"] = torch.cuda.mem_get_info()[1] // 2**20
    for label, impl, env in cases:
        saved = {key: os.environ.get(key) for key in env}
        _set_env(env)
        try:
            out["cases"][label] = _one_case(ctx, importlib.import_module(modules[impl]), sizes)
        finally:
            _set_env(saved)
    return out


def _set_env(env: dict[str, str | None]) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def summary(results: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """One case over the world's ranks: slowest rank's seconds, rank 0's calls, memory (MiB) and
    NCCL timings, whether every rank's sums were right and its destroy freed every group.
    """
    per_rank = [r["cases"][label] for r in results]
    r0 = per_rank[0]
    before, used, after = r0["free_mib"]
    splits = [t["total_s"] for t in r0["nccl"] if t["call"] == "ncclCommSplit"]
    return {
        "init_s": max(r["init_s"] for r in per_rank),
        "usable_s": max(r["usable_s"] for r in per_rank),
        "new_group": r0["new_group"],
        "split_group": r0["split_group"],
        "calls": r0["new_group"] + r0["split_group"],
        "groups": r0["groups"],
        "ok": all(r["sums_ok"] for r in per_rank),
        "paths": sorted({r["creation_path"] for r in per_rank}),
        "held_mib": None if before is None else before - used,
        "kept_mib": None if before is None else before - after,
        "used_mib": None if used is None or results[0]["total_mib"] is None else results[0]["total_mib"] - used,
        "nccl_splits": len(splits),
        "nccl_split_s": sorted(splits)[len(splits) // 2] if splits else None,
        "nccl_split_total_s": round(sum(splits), 3),
    }


def summary_text(label: str, s: dict[str, Any]) -> str:
    """A case's summary as one report line."""
    memory = "no device memory (CPU)" if s["held_mib"] is None else f"groups hold {s['held_mib']} MiB"
    if s["kept_mib"] is not None:
        memory += f" ({s['kept_mib']} MiB not back after destroy; device in use {s['used_mib']} MiB)"
    path = "" if label.startswith("MCore") else f"; creation path {s['paths']}"
    nccl = ""
    if s["nccl_splits"]:
        nccl = (
            f"; rank 0 NCCL: {s['nccl_splits']} ncclCommSplit, median {s['nccl_split_s']} s, "
            f"sum {s['nccl_split_total_s']} s"
        )
    return (
        f"{label}: usable in {s['usable_s']:.2f} s (init {s['init_s']:.2f} s), slowest rank; "
        f"per rank {s['new_group']} new_group + {s['split_group']} split_group, {s['groups']} groups; "
        f"{memory}{path}{nccl}"
    )
