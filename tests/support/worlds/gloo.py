"""A persistent multi-process gloo world for tests: :class:`GlooWorld`.

Spawning processes (and importing torch / megatron in them) is slow on a 2-core machine, so a
world keeps its worker processes alive and runs many test functions on them. Workers start from
multiprocessing's fork server, which has imported torch once (:func:`worker_context`); the
rendezvous is a ``FileStore`` in a fresh temporary directory (no fixed ports, safe under
``pytest -n auto``).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from tests.support.worlds.forking import DISABLE_VAR, env_key

_PRELOAD = ["torch", "torch.distributed"]  # what the fork server imports
_SERVER_ENV: list[dict[str, str]] = []  # the environment (key) the fork server was started with


class WorkerError(RuntimeError):
    """One or more workers raised; ``errors`` maps rank to (exception type name, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str]]):
        self.errors = errors
        details = "\n".join(f"--- rank {r}: {name}\n{tb}" for r, (name, tb) in sorted(errors.items()))
        super().__init__(f"{len(errors)} worker(s) failed:\n{details}")


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def worker_context(env: dict[str, str]) -> Any:
    """The ``forkserver`` context, its server running with ``env``; ``spawn`` where it cannot.

    The server has imported torch once (~1.5 s of CPU per worker otherwise): each worker is
    still a new process that has imported nothing else (no megatron), with ``sys.path`` and the
    main module prepared as ``spawn`` prepares them, and the environment it is given. A world
    whose environment differs in anything torch could read at import from the one the server
    was started with (see :func:`tests.support.releases.forkserver.call`) is spawned instead, as
    is every world with ``$PSNG_RELEASE_FORK=0``. One difference from ``spawn``: forked workers
    share the server's string-hash seed.
    """
    if os.environ.get(DISABLE_VAR) == "0" or (_SERVER_ENV and _SERVER_ENV[0] != env_key(env)):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    with _environ(env):  # the server (started, or restarted after dying, here) imports torch with it
        ctx.set_forkserver_preload(_PRELOAD)
        multiprocessing.forkserver.ensure_running()
    if not _SERVER_ENV:
        atexit.register(_stop_server)
    _SERVER_ENV[:] = [env_key(env)]
    return ctx


def _stop_server() -> None:
    """Stop and reap the fork server at exit (its workers' CPU time then counts for this process)."""
    with contextlib.suppress(Exception):
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]


def _worker(rank: int, world_size: int, store_path: str, inbox, outbox, env: dict) -> None:
    os.environ.clear()  # the parent's environment, as a spawned process gets it
    os.environ.update(env)
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException as exc:  # report everything, keep serving
            outbox.put((rank, False, (type(exc).__name__, traceback.format_exc())))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class GlooWorld:
    """``world_size`` persistent worker processes joined in one gloo world.

        world = GlooWorld(4)
        results = world.run(my_fn, 3)    # my_fn(3) on every rank; list of results by rank
        world.close()

    ``fn`` must be a module-level function (picklable by reference) of an importable module
    (``tests.core.test_grid_gloo``, ``scripts.examples.gpt.training``); the workers inherit the
    parent's ``sys.path`` (the repository root, from ``pythonpath`` in
    pyproject.toml) and its environment at ``GlooWorld(...)`` time plus ``env``. Inside ``fn``
    the default process group is a gloo group over all workers (``torch.distributed.get_rank()``
    etc. work). An exception in any worker is re-raised in the parent as :class:`WorkerError`
    carrying every failing rank's traceback. A world whose worker died or timed out is closed and
    must not be reused.
    """

    def __init__(self, world_size: int, *, env: dict[str, str] | None = None, start_timeout: float = 180.0):
        self.world_size = world_size
        self._tmp = tempfile.mkdtemp(prefix="psng-gloo-")
        overrides = dict(env or {})
        overrides.setdefault("OMP_NUM_THREADS", "1")
        env = {**os.environ, **overrides}
        ctx = worker_context(env)
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, os.path.join(self._tmp, "store"), self._inboxes[r], self._outbox, env),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.closed = False
        self.run(_ready, timeout=start_timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        return self.run_per_rank(fn, [args] * self.world_size, timeout=timeout, **kwargs)

    def run_per_rank(
        self, fn: Callable[..., Any], args_by_rank: list[tuple], *, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Like :meth:`run`, with rank ``r`` calling ``fn(*args_by_rank[r], **kwargs)``."""
        if self.closed:
            raise RuntimeError("this GlooWorld is closed")
        for r, inbox in enumerate(self._inboxes):
            inbox.put((fn, tuple(args_by_rank[r]), kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._outbox.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                self.close()
                raise TimeoutError(
                    f"ranks {missing} did not finish {getattr(fn, '__name__', fn)} in {timeout} s"
                ) from None
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            raise WorkerError(errors)
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers and remove the store directory."""
        if self.closed:
            return
        self.closed = True
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._tmp, ignore_errors=True)


def _ready() -> int:
    import torch.distributed as dist

    return dist.get_rank()
