"""How a :class:`~parallel_state_ng.testing.worlds.GlooWorld` run fails: the errors and the stacks.

:class:`WorkerError`: ranks raised (the world stays usable). :class:`WorldTimeoutError`: ranks did
not finish in time; the message shows where each of them is stuck. :class:`WorkerDiedError`: a
worker process ended. :class:`WorldClosedError`: the world was used after it was closed. After
a timeout or a death the world is closed.

Where a rank is stuck comes from :mod:`faulthandler`: each worker registers :data:`STACK_SIGNAL`
to dump every thread's stack to a file of its own (:func:`register_stack_dump`), and the parent
signals the ranks it waits for and reads the files (:func:`collect_stacks`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import IO, Any

#: The signal a worker answers by writing its threads' stacks (POSIX; none elsewhere).
STACK_SIGNAL: int | None = getattr(signal, "SIGUSR1", None)
#: Seconds the parent waits for a signalled worker's stacks.
STACK_WAIT_S = 3.0


def stack_file(directory: str, rank: int) -> str:
    """The file rank ``rank`` of the world whose temporary directory is ``directory`` dumps into."""
    return os.path.join(directory, f"stacks-rank{rank}.txt")


def register_stack_dump(directory: str, rank: int) -> IO[str] | None:
    """In a worker: dump every thread's stack to :func:`stack_file` on :data:`STACK_SIGNAL`.

    Returns the open file (keep it open for the worker's life), or None where the platform has
    no such signal.
    """
    if STACK_SIGNAL is None:
        return None
    out = open(stack_file(directory, rank), "a", encoding="utf-8")  # open for the process's life
    faulthandler.register(STACK_SIGNAL, file=out, all_threads=True)
    return out


def collect_stacks(directory: str, pids: dict[int, int], wait_s: float = STACK_WAIT_S) -> dict[int, str]:
    """Signal each live rank of ``pids`` (rank -> process id) and return what each dumped.

    A rank that wrote nothing within ``wait_s`` seconds (default :data:`STACK_WAIT_S`) gets a
    line saying so.
    """
    if STACK_SIGNAL is None:
        return {rank: "(no stack: this platform has no SIGUSR1)" for rank in pids}
    sizes: dict[int, int] = {}
    for rank, pid in pids.items():
        path = stack_file(directory, rank)
        sizes[rank] = os.path.getsize(path) if os.path.exists(path) else 0
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    stacks: dict[int, str] = {}
    last: dict[int, int] = {}
    while len(stacks) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in pids:
            path = stack_file(directory, rank)
            size = os.path.getsize(path) if os.path.exists(path) else 0
            if rank not in stacks and size > sizes[rank] and last.get(rank) == size:  # written and settled
                with open(path, encoding="utf-8", errors="replace") as f:
                    f.seek(sizes[rank])
                    stacks[rank] = f.read().rstrip()
            last[rank] = size
    for rank in pids:
        stacks.setdefault(rank, f"(no stack: the process wrote none within {wait_s} s of the signal)")
    return dict(sorted(stacks.items()))


def _sections(title: str, by_rank: dict[int, Any]) -> str:
    return "".join(f"\n--- rank {rank}: {title}\n{text}" for rank, text in sorted(by_rank.items()))


def _raised(errors: dict[int, tuple[str, str]]) -> str:
    return "".join(f"\n--- rank {rank} raised {name}\n{tb.rstrip()}" for rank, (name, tb) in sorted(errors.items()))


class WorldError(RuntimeError):
    """A :class:`~parallel_state_ng.testing.worlds.GlooWorld` run failed (the classes below)."""


class WorkerError(WorldError):
    """Ranks raised; ``errors`` maps each such rank to (exception type name, traceback text).

    Every rank finished, so the world can run the next function.
    """

    def __init__(self, what: str, errors: dict[int, tuple[str, str]]):
        self.errors = dict(sorted(errors.items()))
        super().__init__(f"{what}: rank(s) {list(self.errors)} raised{_raised(self.errors)}")


class WorldTimeoutError(WorldError, TimeoutError):
    """Ranks did not finish within the timeout; the world is closed.

    ``unfinished``: those ranks; ``stacks``: rank -> where it was stuck (its threads' stacks);
    ``errors``: the ranks that raised meanwhile (often why the others wait), as in :class:`WorkerError`.
    """

    def __init__(self, what: str, timeout: float, stacks: dict[int, str], errors: dict[int, tuple[str, str]]):
        self.unfinished = sorted(stacks)
        self.stacks = stacks
        self.errors = dict(sorted(errors.items()))
        #: The failure in one line (the reason a closed world gives).
        self.summary = f"{what}: rank(s) {self.unfinished} did not finish within {timeout} s"
        super().__init__(
            f"{self.summary}; the world is closed"
            f"{_raised(self.errors)}{_sections('stack at the timeout (most recent call first)', stacks)}"
        )


class WorkerDiedError(WorldError):
    """Worker processes ended; the world is closed.

    ``exit_codes``: rank -> its process's exit code (negative: the signal that ended it);
    ``stacks``: where each rank still running was; ``errors``: ranks that raised.
    """

    def __init__(
        self,
        what: str,
        exit_codes: dict[int, int | None],
        stacks: dict[int, str],
        errors: dict[int, tuple[str, str]],
    ):
        self.exit_codes = dict(sorted(exit_codes.items()))
        self.stacks = stacks
        self.errors = dict(sorted(errors.items()))
        codes = ", ".join(f"rank {rank}: exit code {code}" for rank, code in self.exit_codes.items())
        #: The failure in one line (the reason a closed world gives).
        self.summary = f"{what}: the process of rank(s) {list(self.exit_codes)} ended ({codes})"
        super().__init__(
            f"{self.summary}; the world is closed"
            f"{_raised(self.errors)}{_sections('stack of a rank still running', stacks)}"
        )


class WorldClosedError(WorldError):
    """The world was used after it was closed (by :meth:`close`, a timeout or a dead worker)."""
