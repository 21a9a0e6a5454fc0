"""A rank is killed mid-training; the survivors rebuild at a smaller dp and go on, in the same processes.

8 gloo processes train the tiny GPT of ``scripts/examples/train_gpt.py`` at tp 2 x pp 2 x dp 2;
one rank kills itself, the survivors detect, abort, rebuild at dp 1 and restore from an
in-memory copy, and a fresh dp 1 run from the same state must give bit-identical losses
(steps: :func:`restarted_rank`). ``--groups collection``: the same without globals (0.19+).
What it proves and a measured run: docs/results/reliability.md (a GPT loses a rank mid-training).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, NamedTuple

from scripts.examples.gpt.config import TrainConfig


class Training(NamedTuple):
    """What a rank trains with: DDP-wrapped chunks, optimizer, schedule, its stage and dp group."""

    model: list
    optimizer: Any
    forward_backward: Any
    last_stage: bool
    dp_group: Any


class GlobalGroups:
    """``--groups globals``: compat installed into Megatron, ``initialize_model_parallel``."""

    impl = "compat"
    label = "compat installed into Megatron, initialize_model_parallel"

    def init(self, **kwargs: Any) -> Any:
        """``initialize_model_parallel(**kwargs)``; the layout."""
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(**kwargs)
        return ps.get_state().layout

    def setup(self, cfg: TrainConfig) -> Training:
        """Model chunks (DDP-wrapped), optimizer and schedule over the current parallel state."""
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from scripts.examples.gpt.model import ddp_config, optimizer_config, transformer_config
        from scripts.examples.gpt.training import build_model

        seed = cfg.seed + 100 * ps.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        tcfg = transformer_config(cfg)
        chunks = build_model(cfg, tcfg)
        model = [DistributedDataParallel(tcfg, ddp_config(cfg), chunk) for chunk in chunks]
        tcfg.no_sync_func = model[0].no_sync
        tcfg.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(optimizer_config(cfg), model)
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        return Training(model, optimizer, get_forward_backward_func(), last, ps.get_data_parallel_group())

    def rebuild_kwargs(self, plan: Any) -> dict[str, Any]:
        """The arguments of :meth:`init` for the new layout of ``plan``."""
        return plan.initialize_kwargs

    def abort(self) -> None:
        """Every group and the default group aborted (no collective, no store wait)."""
        from megatron.core import parallel_state as ps

        ps.abort_model_parallel(world=True)

    def destroy(self) -> None:
        """Every group of :meth:`init` destroyed."""
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


class CollectionGroups:
    """``--groups collection``: ``build_megatron_groups`` as ``pg_collection=``, Megatron's globals unset.

    No ``initialize_model_parallel`` and no compat install: the abort is
    :func:`~parallel_state_ng.abort_groups` ``(world=True)``, the plan is made over the
    ``MegatronGroups``' layout and the rebuild is ``build_megatron_groups(**plan.build_kwargs)``.
    """

    impl = "mcore"
    label = "parallel_state_ng.build_megatron_groups as pg_collection=, Megatron's globals unset"

    def __init__(self) -> None:
        self.groups: Any = None

    def init(self, **kwargs: Any) -> Any:
        """``build_megatron_groups(**kwargs)`` and Megatron's memory buffer; the layout."""
        from parallel_state_ng import build_megatron_groups, ensure_global_memory_buffer
        from scripts.examples.gpt.collection import require_collection_release

        require_collection_release()
        self.groups = build_megatron_groups(**kwargs)
        ensure_global_memory_buffer()
        return self.groups.layout

    def setup(self, cfg: TrainConfig) -> Training:
        """The same, built by ``scripts.examples.gpt.collection.collection_training`` from this rank's collection."""
        from scripts.examples.gpt.collection import collection_training

        pgc = self.groups.collection()
        _, model, optimizer, forward_backward = collection_training(cfg, pgc)
        return Training(model, optimizer, forward_backward, pgc.pp.rank() == pgc.pp.size() - 1, pgc.dp)

    def rebuild_kwargs(self, plan: Any) -> dict[str, Any]:
        """The arguments of :meth:`init` for the new layout of ``plan``."""
        return plan.build_kwargs

    def abort(self) -> None:
        """Every group and the default group aborted (no collective, no store wait)."""
        from parallel_state_ng import abort_groups

        abort_groups(world=True)  # the memory buffer is scratch memory of no group: kept

    def destroy(self) -> None:
        """Every group of :meth:`init` destroyed, and the memory buffer."""
        from megatron.core import parallel_state as ps

        ps.destroy_global_memory_buffer()
        self.groups.destroy()


GROUPS = {"globals": GlobalGroups, "collection": CollectionGroups}


def _snapshot(model: list, optimizer: Any) -> dict[str, Any]:
    return {
        "params": [[p.detach().clone() for p in m.parameters()] for m in model],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
    }


def _restore(model: list, optimizer: Any, snap: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for m, saved in zip(model, snap["params"], strict=True):
            for p, value in zip(m.parameters(), saved, strict=True):
                p.copy_(value)
    optimizer.load_state_dict(snap["optimizer"])


def _steps(cfg: TrainConfig, t: Training, first: int, count: int) -> list[float]:
    from scripts.examples.gpt.model import train_steps

    losses, _ = train_steps(
        replace(cfg, steps=count),
        t.model,
        t.optimizer,
        t.forward_backward,
        t.last_stage,
        t.dp_group,
        False,
        first_step=first,
    )
    return losses if t.last_stage else []


def restarted_rank(rank: int, cfg: TrainConfig, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """Phase A at dp 2, the kill, detection / abort / rebuild / restore, phase B at dp 1.

    After ``--kill-after`` steps each rank keeps an in-memory copy of its parameters and optimizer
    state and rank ``--victim`` ``SIGKILL``s itself. The survivors detect it in their next step
    (gloo raises at once next to it; the others hit ``--detect-timeout``) and agree on the dead
    through the store (each survivor leaves a mark); abort (no collective, no store wait); rebuild
    with :func:`~parallel_state_ng.layout.rebuild.plan_rebuild` (tp, pp kept, dp 2 -> 1) under a
    new default group over a new prefix of the same store (ranks outside the new world leave);
    restore a new model, DDP and optimizer from the copy; then train the remaining steps.
    """
    import torch
    import torch.distributed as dist

    from parallel_state_ng.groups import creation
    from parallel_state_ng.groups.liveness import agree_on_survivors
    from parallel_state_ng.layout.rebuild import plan_rebuild

    groups = GROUPS[args.groups]()
    layout = groups.init(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp)
    training = groups.setup(cfg)
    _steps(cfg, training, 0, args.kill_after)
    snap = _snapshot(training.model, training.optimizer)  # the in-memory copy every rank keeps
    store = dist.distributed_c10d._get_default_store()
    bound = timedelta(seconds=args.detect_timeout)
    for group in [None, *creation.live_groups()]:  # a bounded collective timeout from now on
        dist.distributed_c10d._set_pg_timeout(bound, group)
    dist.barrier()
    if rank == args.victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t_kill = time.monotonic()
    try:
        _steps(cfg, training, args.kill_after, 1)
        failed_in_step = False
    except RuntimeError:
        failed_in_step = True
    alive = agree_on_survivors(store, rank, cfg.world_size, wait_s=args.agree_wait)
    dead = sorted(set(range(cfg.world_size)) - set(alive))
    t_detect = time.monotonic()
    groups.abort()
    t_abort = time.monotonic()
    plan = plan_rebuild(layout, dead, keep_spares=False)
    new_rank = plan.new_rank_of(rank)
    out: dict[str, Any] = {"rank": rank, "dead": dead, "failed_in_step": failed_in_step, "new_rank": new_rank}
    if new_rank is None:
        return out
    dist.init_process_group(
        "gloo", rank=new_rank, world_size=plan.world_size, store=dist.PrefixStore("restart-1/", store)
    )
    groups.init(**groups.rebuild_kwargs(plan))
    t_rebuild = time.monotonic()
    small = replace(cfg, dp=plan.data_parallel_size)
    training = groups.setup(small)
    assert plan.source_of(new_rank) == rank  # shrink: this rank's own state is its new position's
    _restore(training.model, training.optimizer, snap)
    t_restore = time.monotonic()
    torch.save(snap, os.path.join(directory, f"state-{new_rank}.pt"))
    losses = _steps(small, training, args.kill_after, args.steps - args.kill_after)
    out.update(
        losses=losses,
        seconds={
            "detection": t_detect - t_kill,
            "abort": t_abort - t_detect,
            "rebuild": t_rebuild - t_abort,
            "restore": t_restore - t_rebuild,
        },
        groups_after=len(dist.distributed_c10d._world.pg_map),
    )
    groups.destroy()
    return out


def fresh_rank(rank: int, cfg: TrainConfig, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """The reference: a fresh dp 1 run on the same groups path, loaded from the state the survivors saved."""
    import torch

    groups = GROUPS[args.groups]()
    groups.init(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp)
    training = groups.setup(cfg)
    snap = torch.load(os.path.join(directory, f"state-{rank}.pt"), weights_only=False)
    _restore(training.model, training.optimizer, snap)
    losses = _steps(cfg, training, args.kill_after, args.steps - args.kill_after)
    groups.destroy()
    return {"rank": rank, "losses": losses}


def _rank_main(rank: int, world: int, fn_name: str, cfg: TrainConfig, args: Any, directory: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.filterwarnings("ignore")
    try:
        import torch
        import torch.distributed as dist

        from parallel_state_ng.testing.megatron_cpu import CpuShims, use_megatron_path
        from scripts.examples.gpt.training import parallel_state_impl

        use_megatron_path(args.megatron_path)
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(directory, f"store-{fn_name}"), world)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        with parallel_state_impl(GROUPS[args.groups].impl, "after"), CpuShims() as shims:
            shims.patch_megatron()
            with shims.cuda_to_cpu():
                result = globals()[fn_name](rank, cfg, args, directory)
        out.put((rank, True, result))
    except BaseException as exc:  # reported by the parent
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


def _launch(world: int, fn_name: str, cfg: TrainConfig, args: Any, directory: str, expect: int) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, fn_name, cfg, args, directory, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + args.timeout
    while len(results) < expect and time.monotonic() < deadline:
        try:
            rank, ok, value = out.get(timeout=1.0)
        except queue.Empty:
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        results[rank] = value
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Run the restart and the reference; print the timings and the losses."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument("--victim", type=int, default=5)
    parser.add_argument("--detect-timeout", type=float, default=5.0, help="collective timeout after the kill")
    parser.add_argument(
        "--agree-wait", type=float, default=8.0, help="seconds survivors wait for each other's marks (> detect timeout)"
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--groups",
        choices=sorted(GROUPS),
        default="globals",
        help="; ".join(f"{name}: {cls.label}" for name, cls in GROUPS.items()) + " (megatron-core 0.19+)",
    )
    parser.add_argument("--megatron-path", default=None, help="directory put first on sys.path in every rank")
    args = parser.parse_args(argv)
    from parallel_state_ng.releases import current_release
    from parallel_state_ng.testing.megatron_cpu import use_megatron_path

    use_megatron_path(args.megatron_path)
    release = current_release()
    if args.groups == "collection":
        from scripts.examples.gpt.collection import require_collection_release

        try:
            require_collection_release()
        except RuntimeError as exc:
            print(f"error: {exc}; give a newer one with --megatron-path DIR", file=sys.stderr)
            return 2
    print(f"groups: {args.groups} ({GROUPS[args.groups].label}); megatron-core {release.version}")
    cfg = TrainConfig(impl=GROUPS[args.groups].impl, groups=args.groups, tp=2, pp=2, dp=2)
    with tempfile.TemporaryDirectory() as directory:
        restarted = _launch(cfg.world_size, "restarted_rank", cfg, args, directory, cfg.world_size - 1)
        kept = {r["new_rank"]: r for _, r in sorted(restarted.items()) if r["new_rank"] is not None}
        small = replace(cfg, dp=1)
        fresh = _launch(small.world_size, "fresh_rank", small, args, directory, small.world_size)
    dead = sorted({tuple(r["dead"]) for r in restarted.values()})
    print(f"killed rank {args.victim} after step {args.kill_after}; survivors agreed on dead {dead}")
    print(f"ranks that failed in their next step: {sorted(r for r, v in restarted.items() if v['failed_in_step'])}")
    print(f"new world: old ranks -> new ranks {sorted((v['rank'], k) for k, v in kept.items())}")
    for part in ("detection", "abort", "rebuild", "restore"):
        values = [v["seconds"][part] for v in kept.values()]
        print(f"  {part:9s} max {max(values):.3f} s  (per new rank: {', '.join(f'{x:.3f}' for x in values)})")
    total = max(sum(v["seconds"].values()) for v in kept.values())
    print(f"  kill -> first step after the restart: {total:.3f} s (slowest new rank)")
    restarted_losses = next(v["losses"] for v in kept.values() if v["losses"])
    fresh_losses = next(v["losses"] for v in fresh.values() if v["losses"])
    print(f"losses after the restart: {restarted_losses}")
    print(f"fresh dp1 run, same state: {fresh_losses}")
    same = restarted_losses == fresh_losses
    print(f"bit-identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "restart_gpt")
