"""N ranks on one GPU: a real NCCL world of N processes sharing ``cuda:0`` (docs/results/gpus.md).

NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected": it compares the host
hash and the bus id). :func:`run_world` gives each rank its own ``NCCL_HOSTID``, so NCCL sees N
one-GPU hosts, and turns off the transports that need distinct devices or hosts
(``NCCL_P2P_DISABLE``, ``NCCL_SHM_DISABLE``, ``NCCL_IB_DISABLE``; sockets on ``lo``). Each rank:
``torch.cuda.set_device(0)``, a ``FileStore`` shared by all, ``init_process_group("nccl")``
with ``device_id=cuda:0`` (``mode="bound"``: every new group is an ``ncclCommSplit``) or
without (``mode="lazy"``).

``backend="gloo"`` is the CPU dry run of the same bodies: gloo processes; in the bound mode the
engine is told the world splits (``world_splits``: torch refuses a bound CPU device in
``new_group``, so MCore's groups stay gloo's) and ``torch.distributed.split_group`` is the gloo
stand-in of ``parallel_state_ng/testing/split_stand_in.py`` (collective over the world, as
``ncclCommSplit`` is).

Limits (measured on one H100 80GB, NCCL 2.28.9, 2026-11-27): 8 and 16 ranks worked; 32 failed
inside a split with "unhandled cuda error", most likely GPU memory (each rank's CUDA context and
communicators). The interface is small on purpose (issue 35 builds benchmark bodies on it)::

    results = run_world(8, my_module.body, (arg,), mode="bound")   # one result per rank

where ``body(ctx, *args)`` is a module-level function (processes are spawned) returning
something picklable; ``ctx`` is this rank's :class:`RankContext`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parallel_state_ng.testing.world_failures import collect_stacks, register_stack_dump

BACKENDS = ("nccl", "gloo")
MODES = ("lazy", "bound")
#: Environment every NCCL rank gets (its ``NCCL_HOSTID`` is added per rank).
NCCL_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
}
#: Most ranks known to fit one 80 GB GPU (32 did not).
MEASURED_MAX_RANKS = 16
#: Characters of each stack shown for a rank still running at the timeout.
STACK_CHARS = 4000
#: Seconds a rank still running at the timeout gets to write its stacks (a loaded machine is slow).
STACK_WAIT_S = 10.0


class WorldError(RuntimeError):
    """A rank of the world failed, died or did not finish; ``ranks`` names them."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


@dataclass
class RankContext:
    """What a body gets: its rank, the world's shape and where to make another world.

    ``device`` is ``cuda:0`` on NCCL, ``cpu`` on gloo; ``workdir`` is a directory every rank of
    this world shares (fresh per :func:`run_world`).
    """

    rank: int
    world_size: int
    backend: str
    mode: str
    workdir: str

    @property
    def device(self) -> Any:
        """The rank's device: ``torch.device("cuda", 0)`` on NCCL, the CPU on gloo."""
        import torch

        return torch.device("cuda", 0) if self.backend == "nccl" else torch.device("cpu")

    def init_world(self, name: str = "store", rank: int | None = None, world_size: int | None = None) -> None:
        """``init_process_group`` of this world's backend and mode over the ``FileStore`` ``name``.

        :func:`run_world` calls it once before the body; a body that aborted its world may call
        it again with a new ``name`` (and, for the survivors of a death, their new ``rank`` and
        ``world_size``) to make a new world in the same processes.
        """
        import torch
        import torch.distributed as dist

        rank = self.rank if rank is None else rank
        size = self.world_size if world_size is None else world_size
        store = dist.FileStore(os.path.join(self.workdir, name), size)
        kwargs: dict[str, Any] = {}
        if self.backend == "nccl" and self.mode == "bound":
            kwargs["device_id"] = torch.device("cuda", 0)
        dist.init_process_group(self.backend, rank=rank, world_size=size, store=store, **kwargs)
        if self.backend == "gloo" and self.mode == "bound":
            # a world that splits, to the engine (torch's own new_group refuses a bound CPU device,
            # so MCore keeps gloo's groups); each split collective over the world, as ncclCommSplit is
            import importlib

            split: Any = importlib.import_module("parallel_state_ng.groups.split")
            split.world_splits = lambda: True
            stand_in: Any = importlib.import_module("parallel_state_ng.testing.split_stand_in")
            stand_in.install()
        # every rank connected before any body runs (a rank that finishes early must not close
        # a connection a slower rank's init still makes)
        key = f"{name}/connected"
        store.add(key, 1)
        deadline = time.monotonic() + 600
        while int(store.add(key, 0)) < size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: the other ranks did not connect in 600 s")
            time.sleep(0.01)


def _rank_main(
    rank: int, size: int, spec: tuple[str, str, str, dict[str, str]], body: Callable, args: tuple, results: Any
) -> None:
    """One spawned rank: environment, device, world, ``body``, teardown; reports ``(rank, ok, value)``."""
    backend, mode, workdir, env = spec
    stacks = register_stack_dump(workdir, rank)  # noqa: F841 (open for the process's life)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(env)
    if backend == "nccl":
        os.environ.update(NCCL_ENV)
        os.environ["NCCL_HOSTID"] = f"psng-world-{os.getpid()}-rank{rank}"
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)
        ctx = RankContext(rank, size, backend, mode, workdir)
        ctx.init_world()
        value = body(ctx, *args)
        results.put((rank, True, value))
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it, naming the rank
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    sys.stdout.flush()
    sys.stderr.flush()
    results.close()
    results.join_thread()
    os._exit(0)  # no interpreter teardown: a peer may be dead


def run_world(
    size: int,
    body: Callable[..., Any],
    args: tuple = (),
    *,
    backend: str = "nccl",
    mode: str = "lazy",
    timeout: float = 300.0,
    may_die: Collection[int] = (),
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``body(ctx, *args)`` on ``size`` fresh spawned ranks; their results, by rank.

    ``backend``: ``nccl`` (every rank on ``cuda:0``) or ``gloo`` (the CPU dry run); ``mode``:
    ``lazy`` or ``bound`` (module docstring). A rank in ``may_die`` may end without a result
    (its entry is ``None``): a body that kills it on purpose. ``env``: variables set in every
    rank before torch is imported (e.g. ``TORCH_NCCL_USE_COMM_NONBLOCKING``).

    Raises:
        ValueError: a bad argument.
        WorldError: a rank's body raised (its traceback, by rank), a rank died, or the world did
            not finish in ``timeout`` seconds (the ranks that had not reported, and where each
            one still running was: its threads' Python stacks, dumped by :mod:`faulthandler`
            on ``SIGUSR1``, which also shows a thread blocked in NCCL or gloo); every process
            still alive is then killed.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if backend not in BACKENDS or mode not in MODES:
        raise ValueError(f"backend must be one of {BACKENDS} and mode one of {MODES}, got {backend!r}, {mode!r}")
    ctx = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="psng-world-")
    results = ctx.Queue()
    spec = (backend, mode, workdir, dict(env or {}))
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, spec, body, args, results), daemon=True) for r in range(size)
    ]
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        while len(done) + len(errors) < size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.5)
                (done if ok else errors)[rank] = value
                if not ok:  # the others may wait for it forever: report soon
                    deadline = min(deadline, time.monotonic() + 10)
                continue
            except queue.Empty:
                pass
            for r, proc in enumerate(procs):
                if proc.exitcode is not None and r not in done and r not in errors:
                    _drain(results, done, errors)
                    if r not in done and r not in errors and r not in may_die:
                        errors[r] = f"process exited with code {proc.exitcode} and no result"
            if all(p.exitcode is not None for p in procs):
                _drain(results, done, errors)
                break
        missing = [r for r in range(size) if r not in done and r not in errors and r not in may_die]
        if errors or missing:
            details = [f"--- rank {r}:\n{msg}" for r, msg in sorted(errors.items())]
            if missing:
                details.append(f"--- rank(s) {missing}: no result in {timeout:.0f} s")
                alive = {r: procs[r].pid for r in missing if procs[r].is_alive() and procs[r].pid is not None}
                for r, text in collect_stacks(workdir, alive, wait_s=STACK_WAIT_S).items():
                    details.append(f"--- rank {r}: stack at the timeout (most recent call first)\n{text[:STACK_CHARS]}")
            bad = sorted([*errors, *missing])
            raise WorldError(f"{len(bad)} rank(s) of {size} failed: {bad}\n" + "\n".join(details), bad)
        return [done.get(r) for r in range(size)]
    finally:
        for proc in procs:
            proc.join(timeout=2.0 if not errors else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


def _drain(results: Any, done: dict[int, Any], errors: dict[int, str]) -> None:
    while True:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            return
        (done if ok else errors)[rank] = value


def hello(ctx: RankContext) -> dict[str, Any]:
    """The smallest body: one all-reduce over the world; rank, sum, bound device, whether the world splits."""
    import torch
    import torch.distributed as dist

    from parallel_state_ng.groups import split

    value = torch.ones(1, device=ctx.device)
    dist.all_reduce(value)
    default = dist.distributed_c10d._get_default_group()
    return {
        "rank": ctx.rank,
        "sum": float(value),
        "bound": str(getattr(default, "bound_device_id", None)),
        "splits": split.world_splits(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scripts.gpu world --size 8 --mode bound``: one all-reduce per rank, printed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=8)
    p.add_argument("--backend", choices=BACKENDS, default="nccl")
    p.add_argument("--mode", choices=MODES, default="bound")
    p.add_argument("--timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    start = time.monotonic()
    try:
        out = run_world(a.size, hello, backend=a.backend, mode=a.mode, timeout=a.timeout)
    except WorldError as err:
        print(f"FAILED: {err}")
        return 1
    for row in out:
        print(row)
    ok = all(row["sum"] == a.size for row in out)
    print(f"{'ok' if ok else 'WRONG SUM'}: {a.size} ranks, {a.backend} {a.mode}, {time.monotonic() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("gpu", "world")
