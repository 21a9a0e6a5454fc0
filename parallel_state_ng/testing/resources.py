"""What this process holds, counted: file descriptors, sockets, threads and process groups.

For leak checks around sleep and wake (issue 51) and in the examples that report them:
:func:`process_resources` counts once, :func:`grown` compares two counts. Linux only
(``/proc/self``); elsewhere the descriptor, socket and native-thread counts are ``-1``.
"""

from __future__ import annotations

import os
import threading

import torch.distributed as dist

from parallel_state_ng.groups.creation import live_groups

__all__ = ["RESOURCE_KEYS", "process_resources", "grown"]

#: The keys of :func:`process_resources`, in the order reports show them.
RESOURCE_KEYS = ("fds", "sockets", "threads", "native_threads", "process_groups", "live_groups")


def _descriptors() -> tuple[int, int]:
    """(open file descriptors, of them sockets) from ``/proc/self/fd``; ``(-1, -1)`` without it."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return -1, -1
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed since
            pass
    return len(fds), sockets


def process_resources() -> dict[str, int]:
    """This process's counts: ``fds``, ``sockets``, ``threads`` (Python), ``native_threads``
    (``/proc/self/task``), ``process_groups`` (torch's table of groups, the world group in it,
    0 before ``init_process_group``) and ``live_groups`` (the engine's, see
    :func:`~parallel_state_ng.groups.creation.live_groups`).
    """
    fds, sockets = _descriptors()
    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:
        native = -1
    initialized = dist.is_available() and dist.is_initialized()
    return {
        "fds": fds,
        "sockets": sockets,
        "threads": threading.active_count(),
        "native_threads": native,
        "process_groups": len(dist.distributed_c10d._world.pg_map) if initialized else 0,
        "live_groups": len(live_groups()),
    }


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` for each key of both that grew (an empty dict: nothing grew)."""
    return {k: after[k] - before[k] for k in before.keys() & after.keys() if after[k] > before[k]}
