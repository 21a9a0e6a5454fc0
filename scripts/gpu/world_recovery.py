"""Recovery in place on one GPU: a rank dies between training steps, the survivors shrink and train on.

:func:`recovery` runs on every rank of a world of :mod:`scripts.gpu.world` (8 ranks: the tiny GPT
of :mod:`scripts.examples.gpt` at tp2 pp2 dp2, compat installed into Megatron):

1. ``kill_after`` steps; every rank keeps an in-memory copy of its parameters and optimizer
   state; a barrier (and a device synchronize: nothing in flight), then ``victim`` exits.
2. The survivors agree on the dead through the default store
   (:func:`~parallel_state_ng.groups.liveness.agree_on_survivors`: the dead leave no mark;
   detection inside a collective is the death checks' subject), plan the new layout with
   :func:`~parallel_state_ng.layout.rebuild.plan_rebuild` (tp, pp kept, dp shrunk to the
   replicas left whole), abort compat's groups and rejoin by shrinking the default group
   (:func:`~parallel_state_ng.groups.recovery.rejoin`, ``method="auto"``: torch's
   ``shrink_group`` on NCCL, the gloo stand-in of ``parallel_state_ng/testing/shrink_stand_in.py``
   in the dry run; where the group cannot shrink, the re-initialization it falls back to, whose
   reason the report shows, so that the rest still runs and the shrink's row fails). A survivor
   the plan leaves out aborts everything and stops.
3. The kept ranks build the plan's layout (``initialize_model_parallel``: splits from the shrunk
   group on a bound device), all-reduce once per getter's group, restore the copy into a new
   model and optimizer, and train the remaining steps.
4. The re-init path in the same processes, timed the same way: everything aborted, a new
   default group (``init_process_group`` over a new store), the same layout, the same
   all-reduces; then a fresh run of the new layout from the same copy, whose losses and
   parameters must equal those after the shrink.

:func:`recovery_rows` makes the report's rows.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import replace
from typing import Any

from scripts.examples.gpt.config import TrainConfig
from scripts.gpu.world import RankContext

#: Steps before the kill and in all.
KILL_AFTER, STEPS = 2, 4
#: Seconds each survivor waits for the others' marks (the dead's never comes).
AGREE_WAIT_S = 5.0
Check = tuple[str, bool, str]


def recovery_config(size: int) -> TrainConfig:
    """tp2 pp2 dp rest at 8 ranks or more; tp1 pp2 dp rest below (the 4-rank dry run)."""
    if size < 4 or size % 4:
        raise ValueError(f"the recovery check needs a multiple of 4 ranks (two whole replicas at least), got {size}")
    tp = 2 if size >= 8 else 1
    return TrainConfig(steps=STEPS, init_from_names=True, tp=tp, pp=2, dp=size // (2 * tp))


def victim_of(size: int) -> int:
    """The rank that dies: 5 of 8 (replica 0, last stage), as ``scripts/examples/restart_gpt.py`` kills;
    the survivors of the other replica are renumbered.
    """
    return size // 2 + 1


def _setup(cfg: TrainConfig, device: str) -> dict[str, Any]:
    """Model (weights from their global names), DDP, optimizer and schedule over the current state."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from scripts.examples.gpt.training import seeded_model_and_optimizer

    seed = cfg.seed + 100 * ps.get_pipeline_model_parallel_rank()
    chunks, model, optimizer = seeded_model_and_optimizer(cfg, seed, device)
    return {
        "cfg": cfg,
        "chunks": chunks,
        "model": model,
        "optimizer": optimizer,
        "forward_backward": get_forward_backward_func(),
        "last": ps.is_pipeline_last_stage(ignore_virtual=True),
        "dp_group": ps.get_data_parallel_group(),
    }


def _steps(t: dict[str, Any], first: int, count: int, device: str) -> list[float]:
    from scripts.examples.gpt.model import train_steps

    losses, _ = train_steps(
        replace(t["cfg"], steps=count),
        t["model"],
        t["optimizer"],
        t["forward_backward"],
        t["last"],
        t["dp_group"],
        False,
        first_step=first,
        device=None if device == "cpu" else device,
    )
    return losses if t["last"] else []


def _snapshot(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "params": [[p.detach().clone() for p in m.parameters()] for m in t["model"]],
        "optimizer": copy.deepcopy(t["optimizer"].state_dict()),
    }


def _restore(t: dict[str, Any], snap: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for m, saved in zip(t["model"], snap["params"], strict=True):
            for p, value in zip(m.parameters(), saved, strict=True):
                p.copy_(value)
    # a copy: torch's load_state_dict keeps the given state's tensors, which the steps then change
    t["optimizer"].load_state_dict(copy.deepcopy(snap["optimizer"]))


def _usable(ps: Any, kwargs: dict[str, Any], device: Any) -> dict[str, Any]:
    """``initialize_model_parallel(**kwargs)`` and one all-reduce per getter's group: seconds and facts."""
    from parallel_state_ng.groups.split import creation_path
    from scripts.gpu.world_usable import _touch

    start = time.perf_counter()
    ps.initialize_model_parallel(**kwargs)
    init_s = time.perf_counter() - start
    touched, right = _touch(ps, device)
    return {
        "init_s": init_s,
        "touch_s": time.perf_counter() - start - init_s,
        "touched": touched,
        "sums_ok": right,
        "path": creation_path(),
    }


def recovery(ctx: RankContext, cfg: TrainConfig, victim: int) -> dict[str, Any]:
    """This rank's part (module docstring); the victim never returns."""
    import torch

    from scripts.examples.gpt.training import parallel_state_impl
    from scripts.gpu.train import _on_device
    from scripts.gpu.world_checks import _prepare

    _prepare(ctx)
    device = "cpu" if ctx.backend == "gloo" else str(ctx.device)
    if device != "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)  # CUBLAS_WORKSPACE_CONFIG: the world's env
    else:
        torch.set_num_threads(1)
    with parallel_state_impl("compat", "after"), _on_device(device):
        return _recover(ctx, cfg, victim, device)


def _recover(ctx: RankContext, cfg: TrainConfig, victim: int, device: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel_state_ng.groups.liveness import agree_on_survivors
    from parallel_state_ng.groups.recovery import rejoin
    from parallel_state_ng.layout.rebuild import plan_rebuild
    from scripts.examples.gpt.model import digest

    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp)
    layout = ps.get_state().layout
    training = _setup(cfg, device)
    before = _steps(training, 0, KILL_AFTER, device)
    snap = _snapshot(training)
    store = dist.distributed_c10d._get_default_store()
    if device != "cpu":
        torch.cuda.synchronize()
    dist.barrier()
    if device != "cpu":
        torch.cuda.synchronize()
    if ctx.rank == victim:
        os._exit(17)
    killed = time.perf_counter()
    alive = agree_on_survivors(store, ctx.rank, ctx.world_size, wait_s=AGREE_WAIT_S)
    dead = sorted(set(range(ctx.world_size)) - set(alive))
    out: dict[str, Any] = {"rank": ctx.rank, "dead": dead, "losses_before": before}
    out["detect_s"] = time.perf_counter() - killed
    plan = plan_rebuild(layout, dead, keep_spares=False)
    del training
    start = time.perf_counter()
    ps.abort_model_parallel(world=False)
    shrink = None
    if ctx.backend == "gloo":
        from parallel_state_ng.testing.shrink_stand_in import gloo_shrink

        shrink = gloo_shrink
    done = rejoin(plan, rank=ctx.rank, epoch=1, method="auto", shrink=shrink)
    out.update(new_rank=done.rank, method=done.method, reason=done.reason, rejoin_s=done.seconds)
    if done.rank is None:
        out["initialized"] = dist.is_initialized()
        return out
    out["source"] = plan.source_of(done.rank)
    out["new_world"] = (dist.get_rank(), dist.get_world_size())
    small = replace(cfg, dp=plan.data_parallel_size)
    out["shrink"] = _usable(ps, plan.initialize_kwargs, ctx.device)
    out["shrink"]["total_s"] = time.perf_counter() - start
    out["layout"] = f"tp{small.tp} pp{small.pp} dp{small.dp}"
    training = _setup(small, device)
    _restore(training, snap)
    out["losses_shrink"] = _steps(training, KILL_AFTER, STEPS - KILL_AFTER, device)
    out["digest_shrink"] = digest(training["chunks"])
    del training
    # the re-init path, the same layout, timed the same way; then a fresh run from the same copy
    start = time.perf_counter()
    ps.abort_model_parallel(world=True)
    ctx.init_world("reinit", rank=done.rank, world_size=plan.world_size)
    out["reinit"] = _usable(ps, plan.initialize_kwargs, ctx.device)
    out["reinit"]["total_s"] = time.perf_counter() - start
    training = _setup(small, device)
    _restore(training, snap)
    out["losses_fresh"] = _steps(training, KILL_AFTER, STEPS - KILL_AFTER, device)
    out["digest_fresh"] = digest(training["chunks"])
    del training
    ps.destroy_model_parallel()
    out["groups_left"] = len(dist.distributed_c10d._world.pg_map) - 1
    return out


def recovery_rows(tag: str, victim: int, expected_path: str, results: list[dict[str, Any] | None]) -> list[Check]:
    """``(check, passed, detail)`` rows of a recovery world's results (``None``: the victim)."""
    survivors = [r for r in results if r is not None]
    kept = [r for r in survivors if r["new_rank"] is not None]
    out = [r for r in survivors if r["new_rank"] is None]
    agreed = all(r["dead"] == [victim] for r in survivors)
    rows: list[Check] = [
        (
            f"{tag} recovery: the survivors agree rank {victim} died",
            agreed and results[victim] is None,
            f"dead as seen by the survivors: {sorted({tuple(r['dead']) for r in survivors})}; slowest detection "
            f"{max(r['detect_s'] for r in survivors):.2f} s (a {AGREE_WAIT_S:.0f} s wait for marks)",
        )
    ]
    if not kept:
        return [*rows, (f"{tag} recovery: some survivors rejoin", False, "no survivor got a new rank")]
    paths = sorted({r["shrink"]["path"] for r in kept})
    shrunk = all(r["method"] == "shrink" and r["shrink"]["sums_ok"] for r in kept)
    renumbered = sorted((r["rank"], r["new_rank"]) for r in kept)
    left_out = all(not r["initialized"] for r in out)
    methods = sorted({f"{r['method']} ({r['reason']})" for r in kept})
    detail = (
        f"rejoined by {methods}; kept (old, new): {renumbered}; "
        f"left out {sorted(r['rank'] for r in out)}, holding no group: {left_out}; "
        f"new layout {kept[0]['layout']}, creation path {paths} (expected {expected_path}); "
        f"{kept[0]['shrink']['touched']} getters' groups all-reduced"
    )
    ok = shrunk and left_out and paths == [expected_path] and all(r["source"] == r["rank"] for r in kept)
    rows.append((f"{tag} recovery: shrunk in place, the plan's layout split and used", ok, detail))
    last = [r for r in kept if r["losses_shrink"]]
    same = all(r["losses_shrink"] == r["losses_fresh"] and r["digest_shrink"] == r["digest_fresh"] for r in kept)
    detail = (
        f"losses before the kill {last[0]['losses_before'] if last else None}; after the shrink "
        f"{last[0]['losses_shrink'] if last else None}; fresh run {last[0]['losses_fresh'] if last else None}; "
        f"parameters equal on every kept rank: {same}"
    )
    rows.append(
        (f"{tag} recovery: training after the shrink equals a fresh run of the new layout", same and bool(last), detail)
    )

    def slowest(path: str, part: str) -> float:
        return max(r[path][part] for r in kept)

    detail = (
        f"kill to usable groups, slowest kept rank: shrink {slowest('shrink', 'total_s'):.2f} s "
        f"(rejoin {max(r['rejoin_s'] for r in kept):.2f} s, init {slowest('shrink', 'init_s'):.2f} s, first use "
        f"{slowest('shrink', 'touch_s'):.2f} s) against re-init {slowest('reinit', 'total_s'):.2f} s (init "
        f"{slowest('reinit', 'init_s'):.2f} s, first use {slowest('reinit', 'touch_s'):.2f} s); "
        f"detection not included; groups left at the end {[r['groups_left'] for r in kept]}"
    )
    rows.append((f"{tag} recovery: shrink against re-init", not any(r["groups_left"] for r in kept), detail))
    return rows
