"""The GPU check's ``death-nonblocking`` world: a rank's death in the split sequence under
nonblocking NCCL init (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``) must be named within the bound.

torch waits for a nonblocking communicator up to ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` seconds
(30 minutes unset), not the split's timeout (docs/results/gpus.md, "A rank's death with nonblocking
NCCL init"). The world's ranks get, before torch is imported, the failure bound
(:data:`~scripts.gpu.world_report.DEATH_BOUND_S`), nonblocking init and the longest wait that
bound holds (:func:`~parallel_state_ng.groups.nonblocking.max_nonblocking_timeout`). Each rank
(:func:`death_nonblocking`):

1. with the wait taken out of its environment, calls compat's ``initialize_model_parallel``:
   it must refuse (``NonblockingBoundError``) before any split;
2. runs :func:`scripts.gpu.world_checks.death` with the wait restored: the last rank dies at
   its third split; the survivors must raise naming it within the bound plus the slack, abort,
   and all-reduce in a new world of the survivors.

On gloo (the CPU dry run) the split stand-in waits as torch does for a nonblocking split
(``parallel_state_ng/testing/split_stand_in.py``). :func:`rows` turns the results into check rows.
"""

from __future__ import annotations

import os
import time
from typing import Any

from parallel_state_ng.groups.liveness import ENV_FAILURE_TIMEOUT
from parallel_state_ng.groups.nonblocking import ENV_NONBLOCKING, ENV_NONBLOCKING_TIMEOUT, max_nonblocking_timeout
from scripts.gpu import world_checks
from scripts.gpu.world import RankContext

Check = tuple[str, bool, str]


def world_env(bound_s: float) -> dict[str, str]:
    """The ranks' environment: the failure bound, nonblocking init, the longest wait the bound holds."""
    return {
        ENV_FAILURE_TIMEOUT: str(int(bound_s)),
        ENV_NONBLOCKING: "1",
        ENV_NONBLOCKING_TIMEOUT: str(max_nonblocking_timeout(bound_s)),
    }


def death_nonblocking(ctx: RankContext, victim: int, at_split: int) -> dict[str, Any] | None:
    """The refusal without a bounded wait, then :func:`scripts.gpu.world_checks.death` (module docstring)."""
    world_checks._prepare(ctx)
    import importlib

    from parallel_state_ng.groups.nonblocking import NonblockingBoundError

    ps: Any = importlib.import_module("compat.parallel_state")
    wait = os.environ.pop(ENV_NONBLOCKING_TIMEOUT)  # torch read it already (or will): only compat's check sees this
    start = time.monotonic()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        refusal: str | None = None
    except NonblockingBoundError as exc:
        refusal = str(exc)
    finally:
        os.environ[ENV_NONBLOCKING_TIMEOUT] = wait
    refused_in = round(time.monotonic() - start, 2)
    left = ps.model_parallel_is_initialized()
    if left:  # not refused: leave nothing for the death run
        ps.destroy_model_parallel()
    out = world_checks.death(ctx, victim, at_split)
    if out is None:
        return None
    return {**out, "refusal": refusal, "refused_in": refused_in, "initialized_after_refusal": left, "wait": wait}


def rows(tag: str, size: int, victim: int, at_split: int, bound_s: float, slack_s: float, results: list) -> list[Check]:
    """Check rows of one ``death-nonblocking`` world's results (``None`` for the dead rank)."""
    survivors = [r for r in results if r is not None]
    wait = survivors[0]["wait"] if survivors else "?"
    refused = all(
        r["refusal"]
        and "TORCH_NCCL_NONBLOCKING_TIMEOUT is unset" in r["refusal"]
        and not r["initialized_after_refusal"]
        for r in survivors
    )
    detail = f"slowest {max((r['refused_in'] for r in survivors), default='-')} s; rank 0: " + (
        (survivors[0]["refusal"] or "no refusal")[:160] if survivors else "no result"
    )
    named = all(r["raised"] and r.get("names_victim") for r in survivors)
    slowest = max((r["seconds"] for r in survivors), default=float("inf"))
    usable = bool(survivors) and all(r.get("new_world_sum") == size - 1 for r in survivors)
    kinds = sorted({str(r["raised"]) for r in survivors})
    phases = ", ".join(
        f"{key} {max(r.get(key, 0.0) for r in survivors)} s" for key in ("abort_seconds", "new_world_seconds")
    )
    death_detail = (
        f"survivors raised {kinds}, naming rank {victim}: {named}; slowest {slowest} s (bound {bound_s:.0f} s, "
        f"TORCH_NCCL_NONBLOCKING_TIMEOUT={wait}); then, slowest: {phases}; new world of {size - 1} all-reduced: "
        f"{usable}"
    )
    errors = [r["new_world_error"].splitlines()[0] for r in survivors if "new_world_error" in r]
    if errors:
        death_detail += f"; new world errors: {errors[:2]}"
    if survivors and not survivors[0].get("names_victim"):
        death_detail += f"; rank 0 said: {survivors[0].get('message')}"
    name = f"{tag} death of rank {victim} at split {at_split} (nonblocking NCCL init)"
    return [
        (f"{tag} nonblocking NCCL init without a bounded wait: refused before any split", refused, detail),
        (name, named and slowest <= bound_s + slack_s and usable, death_detail),
    ]
