"""Worlds for tests: one simulated rank of any world, and real gloo worlds of CPU processes.

* :func:`simulated_rank` (a context manager) and :func:`init_simulated_rank` make this process
  rank ``rank`` of a ``world_size``-rank world on torch's fake backend: no peers, no processes,
  any size. Groups are created as on a real rank; collectives do nothing. Good for checking
  which groups a rank creates and what it sees.
* :class:`GlooWorld` is ``world_size`` CPU processes joined in one gloo world that run a
  module-level function on every rank and return the results by rank; the processes are kept
  for the next function. Failures name the ranks: :class:`WorkerError` (ranks raised, with
  their tracebacks), :class:`WorldTimeoutError` (ranks did not finish in time, with the stacks
  where they are stuck), :class:`WorkerDiedError` (a process ended); after the last two the
  world is closed and refuses further use (:class:`WorldClosedError`).

The pytest fixtures over both are in :mod:`parallel_state_ng.testing.pytest_plugin`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from parallel_state_ng.testing.forking import run_in_environ, worker_context
from parallel_state_ng.testing.simulated import (
    check_int,
    check_seconds,
    destroy_simulated_world,
    init_simulated_rank,
    simulated_rank,
)
from parallel_state_ng.testing.world_failures import (
    WorkerDiedError,
    WorkerError,
    WorldClosedError,
    WorldError,
    WorldTimeoutError,
    collect_stacks,
    register_stack_dump,
)

__all__ = [
    "GlooWorld",
    "WorkerDiedError",
    "WorkerError",
    "WorldClosedError",
    "WorldError",
    "WorldTimeoutError",
    "destroy_simulated_world",
    "init_simulated_rank",
    "simulated_rank",
]

#: Seconds between two checks that the workers are alive while a run waits.
_POLL_S = 0.5


# --------------------------------------------------------------------------- gloo worlds
def _error() -> tuple[str, str]:
    """The exception being handled as (type name, traceback text)."""
    exc = sys.exc_info()[1]
    return type(exc).__name__, traceback.format_exc()


def _worker(rank: int, world_size: int, directory: str, inbox: Any, outbox: Any) -> None:
    """One rank (started through :func:`run_in_environ`, with the parent's environment): join
    the gloo world, then run each task from ``inbox`` until ``None``.
    """
    stacks = register_stack_dump(directory, rank)  # noqa: F841 - kept open while the worker lives
    try:
        import torch.distributed as dist

        store = dist.FileStore(os.path.join(directory, "store"), world_size)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    except BaseException:  # reported; the process then ends, which the parent sees
        outbox.put((rank, False, _error()))
        outbox.close()
        outbox.join_thread()
        sys.exit(1)
    while True:
        task = inbox.get()
        if task is None:
            break
        answer: tuple[int, bool, Any]
        try:
            fn, args, kwargs = pickle.loads(task)
            answer = (rank, True, pickle.dumps(fn(*args, **kwargs)))
        except BaseException:  # report everything, keep serving
            answer = (rank, False, _error())
        outbox.put(answer)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _ready() -> int:
    """The first task of every world: each worker answers once it has joined."""
    import torch.distributed as dist

    return dist.get_rank()


def _name(fn: Any) -> str:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(fn)


def _check_fn(fn: Any) -> None:
    """``fn`` must reach the workers by reference: a module-level function of an importable module."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r} ({type(fn).__name__})")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        kind = "a lambda" if "<lambda>" in qualname else "a local function"
        raise TypeError(
            f"fn={_name(fn)} is {kind}: the workers import fn by module and name, so it must be a "
            "function defined at module level of an importable module"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"fn={_name(fn)} cannot be sent to the workers by reference: {exc}") from None


class GlooWorld:
    """``world_size`` CPU processes joined in one gloo world, kept to run many functions.

        with GlooWorld(2) as world:
            world.run(torch.distributed.get_rank)  # [0, 1]

    ``fn`` must be a module-level function of a module the workers can import (a test module
    of your suite is fine; lambdas and local functions are refused). Inside ``fn`` the default
    process group is the gloo world (``torch.distributed.get_rank()``, collectives). The
    workers get ``sys.path`` and the environment of the parent at construction, updated with
    ``env`` (``OMP_NUM_THREADS`` defaults to 1). They are forked from a server that has imported
    torch (:mod:`parallel_state_ng.testing.forking`), and meet through a ``FileStore`` in a
    fresh temporary directory: no ports, so any number of worlds may run side by side (``pytest
    -n auto``).

    Args:
        world_size: the number of processes (ranks).
        env: environment variables set in the workers on top of the parent's.
        timeout: seconds a run may take by default before :class:`WorldTimeoutError`.
        start_timeout: seconds the workers may take to start and join the world.

    Raises:
        TypeError, ValueError: an argument out of range (named in the message).
        WorldError: the workers did not start (the world is then closed).
    """

    def __init__(
        self,
        world_size: int,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        start_timeout: float = 180.0,
    ):
        self.world_size = check_int("world_size", world_size, 1)
        self.timeout = check_seconds("timeout", timeout)
        start_timeout = check_seconds("start_timeout", start_timeout)
        overrides = dict(env or {})
        bad = {k: v for k, v in overrides.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise TypeError(f"env must map str to str, got {bad!r}")
        overrides.setdefault("OMP_NUM_THREADS", "1")
        full_env = {**os.environ, **overrides}
        self._closed_because: str | None = None
        self._directory = tempfile.mkdtemp(prefix="psng-gloo-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._directory, ignore_errors=True)
        ctx = worker_context(full_env)
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=run_in_environ,
                args=(full_env, _worker, r, world_size, self._directory, self._inboxes[r], self._outbox),
                daemon=True,
                name=f"psng-gloo-rank{r}",
            )
            for r in range(world_size)
        ]
        try:
            for p in self._procs:
                p.start()
            self._run_tasks(_ready, [((), {})] * world_size, start_timeout, f"GlooWorld({world_size}) start")
        except BaseException:
            self._close("its start failed", hung=[r for r, p in enumerate(self._procs) if p.pid is not None])
            raise

    @property
    def closed(self) -> bool:
        """Whether the world is closed (by :meth:`close`, a timeout or a dead worker)."""
        return self._closed_because is not None

    def __repr__(self) -> str:
        state = f"closed: {self._closed_because}" if self.closed else "open"
        return f"GlooWorld({self.world_size}, {state})"

    def __enter__(self) -> GlooWorld:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results ordered by rank.

        ``timeout`` (default: the world's) bounds the whole run; it is not passed to ``fn``.

        Raises:
            TypeError, ValueError: ``fn`` cannot reach the workers, ``timeout`` or the arguments are bad.
            WorkerError: ranks raised (every rank finished; the world stays usable).
            WorldTimeoutError, WorkerDiedError: ranks did not finish, or a process ended (closed).
            WorldClosedError: the world is closed.
        """
        return self.run_per_rank(fn, [args] * self.world_size, timeout=timeout, **kwargs)

    def run_per_rank(
        self,
        fn: Callable[..., Any],
        args_by_rank: Sequence[Sequence[Any]],
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Like :meth:`run`, with rank ``r`` calling ``fn(*args_by_rank[r], **kwargs)``."""
        _check_fn(fn)
        seconds = self.timeout if timeout is None else check_seconds("timeout", timeout)
        if isinstance(args_by_rank, (str, bytes)) or not isinstance(args_by_rank, Sequence):
            raise TypeError(f"args_by_rank must be a sequence of argument tuples, got {type(args_by_rank).__name__}")
        if len(args_by_rank) != self.world_size:
            raise ValueError(
                f"args_by_rank must hold one argument tuple per rank (world_size={self.world_size}), "
                f"got {len(args_by_rank)}"
            )
        for r, args in enumerate(args_by_rank):
            if not isinstance(args, (tuple, list)):
                raise TypeError(f"args_by_rank[{r}] must be a tuple or list of arguments, got {args!r}")
        self._check_open()
        tasks = [(tuple(args), kwargs) for args in args_by_rank]
        return self._run_tasks(fn, tasks, seconds, _name(fn))

    def close(self) -> None:
        """Stop the workers and remove the world's temporary directory (nothing if already closed)."""
        self._close("close() was called", hung=())

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed_because is not None:
            raise WorldClosedError(
                f"this GlooWorld({self.world_size}) is closed ({self._closed_because}); make a new one"
            )

    def _run_tasks(self, fn: Callable[..., Any], tasks: list[tuple[tuple, dict]], timeout: float, what: str) -> list:
        """Send each rank its task, wait for all answers within ``timeout``, return the results."""
        payloads = []
        for r, (args, kwargs) in enumerate(tasks):
            try:
                payloads.append(pickle.dumps((fn, args, kwargs)))
            except Exception as exc:
                raise TypeError(f"the arguments of {what} for rank {r} cannot be pickled: {exc}") from None
        self._check_open()
        if dead := self._dead():  # a worker that died since the last run
            self._fail(what, timeout, {}, dead, in_flight=False)
        for inbox, payload in zip(self._inboxes, payloads, strict=True):
            inbox.put(payload)
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(answers) < self.world_size:
                left = deadline - time.monotonic()
                try:
                    rank, ok, value = self._outbox.get(timeout=max(0.0, min(_POLL_S, left)))
                except queue.Empty:
                    rank = None
                if rank is not None:
                    answers[rank] = (ok, value)
                elif (dead := self._dead()) or time.monotonic() >= deadline:
                    self._fail(what, timeout, answers, dead, in_flight=True)
        except WorldError:
            raise
        except BaseException:  # interrupted (Ctrl-C): the workers' answers can no longer be matched
            self._close(f"{what} was interrupted", hung=range(self.world_size))
            raise
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        for rank, (ok, value) in answers.items():
            if not ok:
                errors[rank] = value
                continue
            try:
                results[rank] = pickle.loads(value)
            except Exception:
                errors[rank] = _error()
        if errors:
            raise WorkerError(what, errors)
        return [results[r] for r in range(self.world_size)]

    def _dead(self) -> dict[int, int | None]:
        """Rank -> exit code of each worker process that has ended."""
        return {r: p.exitcode for r, p in enumerate(self._procs) if p.pid is not None and not p.is_alive()}

    def _fail(
        self,
        what: str,
        timeout: float,
        answers: dict[int, tuple[bool, Any]],
        dead: dict[int, int | None],
        *,
        in_flight: bool,
    ) -> None:
        """Close the world and raise: :class:`WorkerDiedError` if ``dead``, else :class:`WorldTimeoutError`.

        The answers already sent are taken first (a worker whose start failed reports why, then
        ends; or every rank answered at the deadline after all: then nothing is raised); then the
        ranks still running the task are signalled for their stacks and stopped.
        """
        while True:
            try:
                rank, ok, value = self._outbox.get(timeout=0.2 if dead else 0)
            except queue.Empty:
                break
            answers[rank] = (ok, value)
        if not dead and len(answers) == self.world_size:
            return  # the last answers came in at the deadline
        errors = {r: value for r, (ok, value) in answers.items() if not ok}
        running = [r for r in range(self.world_size) if r not in dead and r not in answers] if in_flight else []
        pids = {r: self._procs[r].pid for r in running}
        stacks = collect_stacks(self._directory, {r: pid for r, pid in pids.items() if pid is not None})
        failure: WorldTimeoutError | WorkerDiedError
        if dead:
            failure = WorkerDiedError(what, dead, stacks, errors)
        else:
            failure = WorldTimeoutError(what, timeout, stacks, errors)
        self._close(failure.summary, hung=running)
        raise failure

    def _close(self, reason: str, hung: Iterable[int]) -> None:
        """Stop the workers (``hung`` ones at once, the others after they finish) and clean up."""
        if self._closed_because is not None:
            return
        self._closed_because = reason
        hung = set(hung)
        for r, inbox in enumerate(self._inboxes):
            if r not in hung:
                with contextlib.suppress(Exception):
                    inbox.put(None)
        for r, p in enumerate(self._procs):
            if p.pid is None:  # never started
                continue
            if r in hung:
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in [*self._inboxes, self._outbox]:
            q.close()
            q.cancel_join_thread()
        self._cleanup()
