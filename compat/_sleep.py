"""``sleep_model_parallel``, ``wake_model_parallel`` and ``model_parallel_asleep`` of ``compat.parallel_state``.

Not MCore API (names chosen not to collide with it): for colocated RL jobs that alternate
Megatron training with a rollout engine on the same devices. Every communicator the engine
holds in this process sleeps: the active grid's groups and gloo twins, detached grids, grids,
collections and registry leases (:func:`parallel_state_ng.groups.creation.live_groups`); a
group shared by several kinds sleeps once. Megatron keeps the very same group objects: after
``wake_model_parallel`` every getter returns what it returned before. The mechanism per group
and its limits: :mod:`parallel_state_ng.groups.sleep` (docs/compat.md, "Sleep and wake").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from parallel_state_ng.groups import sleep as _sleep

__all__ = ["sleep_model_parallel", "wake_model_parallel", "model_parallel_asleep"]


def sleep_model_parallel(
    *, kinds: Iterable[str] | None = None, timeout: float = _sleep.DEFAULT_TIMEOUT_S
) -> _sleep.SleepReport:
    """Put every group the engine holds to sleep, once every rank of the world calls it.

    ``kinds`` limits it to the groups whose ``group_desc`` names one of these kinds. A collective
    on a sleeping group raises :class:`~parallel_state_ng.groups.sleep.GroupAsleepError` naming
    it; call :func:`wake_model_parallel` first. Returns this rank's report (the mechanism per
    group, bytes freed where the backend reports them).

    Raises:
        ParallelConfigTimeoutError: a rank did not call within ``timeout`` seconds (named).
        ParallelConfigMismatchError: ranks passed different ``kinds`` or called wake instead.
    """
    return _sleep.sleep(kinds=kinds, timeout=timeout)


def wake_model_parallel(
    *, kinds: Iterable[str] | None = None, timeout: float = _sleep.DEFAULT_TIMEOUT_S
) -> _sleep.SleepReport:
    """Wake every sleeping group (the same objects as before), once every rank of the world calls it."""
    return _sleep.wake(kinds=kinds, timeout=timeout)


@contextmanager
def model_parallel_asleep(
    *, kinds: Iterable[str] | None = None, timeout: float = _sleep.DEFAULT_TIMEOUT_S
) -> Iterator[_sleep.SleepReport]:
    """The engine's groups asleep inside the ``with`` block, awake again after it (also on error)."""
    with _sleep.asleep(kinds=kinds, timeout=timeout) as report:
        yield report
