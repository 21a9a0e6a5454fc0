"""The GPU check's per-rank bodies for an N-rank world on one GPU (:mod:`scripts.gpu.world`).

* :func:`compat_vs_mcore`: MCore's then compat's ``initialize_model_parallel`` with the same
  sizes, NCCL YAML and high-priority groups: creation calls and options side by side, each
  getter's members, an all-reduce over every group compat made, destroy counts.
* :func:`builders`: ``build_megatron_groups`` and ``HyperCommGrid`` (the split path in the
  bound mode): an all-reduce over each group, then destroy.
* :func:`death`: one rank dies inside the split sequence; the survivors must raise within the
  failure bound naming it, abort, and make a new world of the survivors in the same processes
  (with nonblocking NCCL init: :mod:`scripts.gpu.world_nonblocking`).

The training body (MCore against compat, bit for bit) is :mod:`scripts.gpu.world_training`.

Each returns a small picklable dict; the checks on it are made in :mod:`scripts.gpu.check`.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from parallel_state_ng.groups.liveness import ENV_FAILURE_TIMEOUT
from scripts.gpu.world import RankContext

#: The layouts compared at 8 ranks (16: the same with dp doubled).
LAYOUTS = {
    "tp2 pp2 ep2": {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
    },
    "tp2 cp2": {"tensor_model_parallel_size": 2, "context_parallel_size": 2},
}


def _prepare(ctx: RankContext) -> None:
    import warnings

    from parallel_state_ng.testing.megatron_cpu import use_megatron_path

    warnings.filterwarnings("ignore")
    use_megatron_path()


def _row_text(row: dict[str, Any]) -> str:
    """One mismatching creation call: MCore's options and timeout against compat's."""
    other = row.get("compat") or {}
    return (
        f"{row['desc']} {row['backend']} {row['ranks']}: MCore {row['options']} / {row['timeout']}, "
        f"compat {other.get('options', '(none)')} / {other.get('timeout', '-')}"
    )


def compat_vs_mcore(ctx: RankContext, sizes: dict[str, Any]) -> dict[str, Any]:
    """MCore vs compat on this rank (:func:`scripts.gpu.options.compare_options`), summarized."""
    _prepare(ctx)
    from parallel_state_ng.groups.split import creation_path
    from scripts.gpu.options import compare_options

    start = time.monotonic()
    path = creation_path()
    # compat creates a gloo group with the short failure bound, then gives it the caller's
    # timeout (groups/liveness.py, guarded_create); the calls are compared as MCore makes them,
    # so the bound is off here (the death check runs with it).
    saved = os.environ.get(ENV_FAILURE_TIMEOUT)
    os.environ[ENV_FAILURE_TIMEOUT] = "0"
    try:
        result = compare_options(os.path.join(ctx.workdir, "options"), ctx.device.type, sizes)
    finally:
        if saved is None:
            os.environ.pop(ENV_FAILURE_TIMEOUT, None)
        else:
            os.environ[ENV_FAILURE_TIMEOUT] = saved
    return {
        "rank": ctx.rank,
        "creation_path": path,
        "mismatches": result["mismatches"],
        "mismatch_samples": [_row_text(row) for row in result["rows"] if not row["same"]][:3],
        "mcore_calls": result["mcore_calls"],
        "compat_calls_by_kind": result["compat_calls_by_kind"],
        "counts": result["counts"],
        "mcore_leaked": result["mcore_leaked"],
        "getters_compared": result["getters_compared"],
        "member_mismatches": result["member_mismatches"],
        "real_nccl_options": result["real_nccl_options"],
        "seconds": round(time.monotonic() - start, 2),
    }


def _sum_check(group: Any, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    if group is None:
        return True
    ranks = dist.get_process_group_ranks(group)
    value = torch.tensor([float(dist.get_rank())], device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(value, group=group)
    return float(value) == float(sum(ranks))


def builders(ctx: RankContext) -> dict[str, Any]:
    """``build_megatron_groups`` (tp 2, pp 2) and a ``HyperCommGrid`` (tp 2 × dp rest): sums, destroy."""
    _prepare(ctx)
    import torch.distributed as dist

    from parallel_state_ng import HyperCommGrid, build_megatron_groups
    from parallel_state_ng.groups.split import creation_path

    before = len(dist.distributed_c10d._world.pg_map)
    out: dict[str, Any] = {"rank": ctx.rank, "creation_path": creation_path()}
    groups = build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    kinds = [k for k in ("tp", "pp", "dp", "mp", "tp_dp") if groups.group(k) is not None]
    out["megatron_sums_ok"] = all(_sum_check(groups.group(k), ctx.device) for k in kinds)
    out["megatron_kinds"] = kinds
    groups.destroy()
    grid = HyperCommGrid([2, ctx.world_size // 2], ["tp", "dp"])
    made = [grid.create_pg(["tp"]), grid.create_pg(["dp"]), grid.create_pg(["tp", "dp"])]
    out["grid_sums_ok"] = all(_sum_check(g, ctx.device) for g in made)
    grid.destroy()
    out["left"] = len(dist.distributed_c10d._world.pg_map) - before
    return out


def death(ctx: RankContext, victim: int, at_split: int) -> dict[str, Any] | None:
    """``victim`` dies (``os._exit``) at its ``at_split``-th split of compat's init (tp 2, pp 2);
    the others report what they raised, how fast, then abort and all-reduce in a new world.
    """
    _prepare(ctx)
    import importlib

    import torch
    import torch.distributed as dist

    ps: Any = importlib.import_module("compat.parallel_state")  # the facade's names are set at import

    if ctx.rank == victim:
        real = dist.split_group
        calls = [0]

        def dying_split(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == at_split:
                os._exit(17)
            return real(*args, **kwargs)

        setattr(dist, "split_group", dying_split)  # noqa: B010 (mypy: torch's signature)
    out: dict[str, Any] = {"rank": ctx.rank}
    start = time.monotonic()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        out["raised"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        out["raised"] = type(exc).__name__
        out["message"] = str(exc).splitlines()[0][:300]
        out["names_victim"] = str(victim) in str(getattr(exc, "dead", "")) or f"rank {victim}" in str(exc)
    out["seconds"] = round(time.monotonic() - start, 2)
    try:
        start = time.monotonic()
        ps.abort_model_parallel(world=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        out["abort_seconds"] = round(time.monotonic() - start, 2)
        start = time.monotonic()
        new_rank = ctx.rank - (ctx.rank > victim)
        ctx.init_world("after-death", rank=new_rank, world_size=ctx.world_size - 1)
        value = torch.ones(1, device=ctx.device)
        dist.all_reduce(value)
        out["new_world_sum"] = float(value)
        out["new_world_seconds"] = round(time.monotonic() - start, 2)
    except Exception as exc:  # noqa: BLE001 - reported
        out["new_world_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"[:2000]
    return out


def every_check(ctx: RankContext, layouts: dict[str, dict[str, Any]], with_builders: bool = True) -> dict[str, Any]:
    """:func:`compat_vs_mcore` for each of ``layouts`` (label -> sizes), then :func:`builders`
    (``None`` without ``with_builders``), in one world.
    """
    return {
        "layouts": {label: compat_vs_mcore(ctx, sizes) for label, sizes in layouts.items()},
        "builders": builders(ctx) if with_builders else None,
    }
