"""The GPU check's training body for an N-rank world: MCore's own parallel_state, then compat.

:func:`training` runs in every rank of a world of :mod:`scripts.gpu.world`: for each layout of
:func:`training_layouts`, the tiny GPT of :mod:`scripts.examples.gpt` (model, data, optimizer and
step loop all from there: :func:`scripts.examples.gpt.training.run_once`) trains a few steps
under megatron-core's own ``parallel_state``, which is then destroyed, and the same steps under
compat, installed after megatron's import (as :mod:`scripts.gpu.train` does at world size 1).
On NCCL the parameters and microbatches live on ``cuda:0`` (every rank shares it) with
deterministic algorithms; on gloo (the CPU dry run) Megatron runs on the CPU stand-ins.

:func:`training_rows` turns the ranks' results into ``(check, passed, detail)`` rows: losses,
gradient norms and each rank's parameter digest bit-identical to MCore's, megatron's code
resolved to compat during compat's run, and no group left after compat's destroy.
"""

from __future__ import annotations

import math
import time
from typing import Any

from scripts.examples.gpt.config import TrainConfig, validate
from scripts.gpu.world import RankContext

#: The layouts trained (``dense``: tp2 pp2 dp rest; ``moe``: tp1 pp2 dp rest, ep2, 4 experts, all-to-all).
LAYOUT_NAMES = ("dense", "moe")
#: Optimizer steps per run (each layout trains twice per rank: MCore, then compat).
STEPS = 3
Check = tuple[str, bool, str]


def training_layouts(size: int, names: tuple[str, ...] = LAYOUT_NAMES, steps: int = STEPS) -> dict[str, TrainConfig]:
    """The configs trained in a world of ``size`` ranks (a multiple of 4), by label.

    ``dense`` is tp2 pp2 with dp ``size // 4`` (tp2 pp2 dp2 at 8 ranks); ``moe`` is tp1 pp2 with dp
    ``size // 2``, expert parallelism 2 over 4 experts, the all-to-all dispatcher (MoE with tp > 1
    needs sequence parallelism, whose norms need TransformerEngine or apex). Weights come from
    their global names, so every layout trains the same global model.
    """
    if size < 4 or size % 4:
        raise ValueError(f"training needs a world of a multiple of 4 ranks (tp2 pp2 / pp2 ep2), got {size}")
    bad = [n for n in names if n not in LAYOUT_NAMES]
    if bad:
        raise ValueError(f"training layouts are {LAYOUT_NAMES}, got {bad}")
    base = TrainConfig(steps=steps, init_from_names=True)
    every = {
        "dense": base.replace(tp=2, pp=2, dp=size // 4),
        "moe": base.replace(tp=1, pp=2, dp=size // 2, ep=2, experts=4, dispatcher="alltoall"),
    }
    return {validate(every[n]).label(): every[n] for n in names}


def _pg_count() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def training(ctx: RankContext, layouts: dict[str, TrainConfig]) -> dict[str, Any]:
    """Each of ``layouts`` (label -> config) trained under MCore, then under compat, on this rank.

    Returns ``rank``, ``device``, per label ``mcore`` and ``compat``: ``losses`` (last pipeline
    stage only, else ``None``), ``grad_norms``, ``digest`` (this rank's parameters after the
    steps), ``facts`` (which parallel_state megatron's code resolved to), ``leaked_groups``
    (groups alive after ``destroy_model_parallel``), ``seconds``; and ``groups_left`` (groups
    besides the default one when everything is done).
    """
    import warnings

    import torch

    from parallel_state_ng.testing.megatron_cpu import use_megatron_path
    from scripts.examples.gpt.training import parallel_state_impl, run_once

    warnings.filterwarnings("ignore")
    use_megatron_path()
    device = "cpu"
    if ctx.backend == "nccl":
        device = str(ctx.device)
        # CUBLAS_WORKSPACE_CONFIG is set before CUDA starts (world_report passes it in env)
        torch.use_deterministic_algorithms(True, warn_only=True)
    out: dict[str, Any] = {"rank": ctx.rank, "device": device, "layouts": {}}
    for label, cfg in layouts.items():
        runs: dict[str, Any] = {}
        for impl in ("mcore", "compat"):
            start = time.monotonic()
            with parallel_state_impl(impl, "after"):
                result = run_once(cfg.replace(impl=impl, install="after"), device=device)
            result["wall_s"] = round(time.monotonic() - start, 2)
            runs[impl] = result
        out["layouts"][label] = runs
    out["groups_left"] = _pg_count() - 1
    return out


FIELDS = ("losses", "grad_norms", "digest", "params")


def _compat_used(run: dict[str, Any]) -> bool:
    facts = {k: v for k, v in run["facts"].items() if k != "version"}
    return set(facts.values()) == {"compat.parallel_state", "True"}


def training_rows(tag: str, results: list[dict[str, Any]]) -> list[Check]:
    """``(check, passed, detail)`` rows for every layout of a world's :func:`training` results."""
    rows: list[Check] = []
    for label in results[0]["layouts"]:
        per_rank = [r["layouts"][label] for r in results]
        differ = [
            (r["rank"], f)
            for r, runs in zip(results, per_rank, strict=True)
            for f in FIELDS
            if runs["mcore"][f] != runs["compat"][f]
        ]
        losses = [runs["mcore"]["losses"] for runs in per_rank if runs["mcore"]["losses"] is not None]
        agree = bool(losses) and all(x == losses[0] for x in losses)
        finite = bool(losses) and all(math.isfinite(x) for x in losses[0])
        ref = per_rank[0]["mcore"]
        compat_losses = next(runs["compat"]["losses"] for runs in per_rank if runs["compat"]["losses"] is not None)
        digests = sorted({runs["compat"]["digest"][:12] for runs in per_rank})
        steps = len(losses[0]) if losses else 0
        detail = (
            f"{len(results)} ranks on {results[0]['device']} ({ref['param_device']}), {steps} steps; "
            f"losses MCore {losses[0] if losses else None} compat {compat_losses}; "
            f"{len(digests)} distinct rank digests, each equal to MCore's: {not differ}"
        )
        if differ:
            detail += f"; differs (rank, field): {differ[:6]}"
        if not agree or not finite:
            detail += f"; last-stage ranks disagree or not finite: {losses}"
        slowest = max(runs[i]["wall_s"] for runs in per_rank for i in ("mcore", "compat"))
        detail += f"; slowest run {slowest} s"
        rows.append((f"{tag} training {label}: bit-identical to MCore", not differ and agree and finite, detail))
        unused = [r["rank"] for r, runs in zip(results, per_rank, strict=True) if not _compat_used(runs["compat"])]
        own = "megatron.core.parallel_state"
        mcore_own = all(runs["mcore"]["facts"]["schedules.parallel_state"] == own for runs in per_rank)
        rows.append(
            (
                f"{tag} training {label}: megatron's code used compat",
                not unused and mcore_own,
                f"compat's run: {per_rank[0]['compat']['facts']} (ranks not using it: {unused or 'none'}); "
                f"MCore's run used megatron.core.parallel_state: {mcore_own}",
            )
        )
        leaked = [runs["compat"]["leaked_groups"] for runs in per_rank]
        rows.append(
            (
                f"{tag} training {label}: no group left after compat's destroy",
                not any(leaked),
                f"compat left {leaked}; MCore left {per_rank[0]['mcore']['leaked_groups']} on rank 0 "
                "(destroyed by the check before compat's run)",
            )
        )
    left = [r["groups_left"] for r in results]
    rows.append((f"{tag} training: no group left at the end", not any(left), f"groups besides the default: {left}"))
    return rows
