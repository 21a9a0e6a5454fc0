"""The process-wide communicator registry: one communicator per sharing key over every layout.

With ``PSNG_SHARE_GROUPS=process`` (:mod:`parallel_state_ng.groups.sharing`) every
:class:`~parallel_state_ng.groups.sharing.GroupPool` of every layout built in this process
(compat's state, grids, ``build_megatron_groups``, topologies, inference collections, rebuilds)
asks this registry first: a request whose sharing key (members in order, backend, options,
timeout) a live layout already holds gets that layout's communicator. Each layout holds its
communicators through one :class:`Lease`; destroying the layout gives the lease back once
(a second destroy finds it empty), and a communicator is destroyed when its last lease is
given back. Bookkeeping only: nothing here talks to torch;
:mod:`parallel_state_ng.groups.creation` empties it with a new world and after an abort, and
asks it before destroying a group. See docs/compat.md ("Several layouts in one process").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Lease", "acquire", "holders", "held", "forget", "clear", "entries"]


@dataclass
class _Entry:
    group: Any
    holders: int


# sharing key -> the live communicator and how many leases hold it
_entries: dict[Hashable, _Entry] = {}
# id(communicator) -> its sharing key
_keys: dict[int, Hashable] = {}


class Lease:
    """One layout's hold on registry communicators: taken by its pools, given back by its destroy.

    :meth:`release` is idempotent: it empties the lease, so destroying a layout twice gives
    back nothing the second time. A lease never decrements a communicator it does not hold
    (e.g. one that an abort or a new world dropped and a later layout created again).
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[Hashable, Any] = {}

    def holds(self, key: Hashable) -> bool:
        """Whether this lease holds the communicator of ``key``."""
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def release(self) -> list[Any]:
        """Give back every communicator held; returns those whose last holder this lease was.

        Those are out of the registry afterwards: the caller destroys them (through
        :func:`parallel_state_ng.groups.creation.destroy_groups`, which this lease is passed to).
        """
        freed = []
        held, self._held = self._held, {}
        for key, group in held.items():
            entry = _entries.get(key)
            if entry is None or entry.group is not group:
                continue  # dropped by an abort or a new world
            entry.holders -= 1
            if entry.holders == 0:
                del _entries[key]
                _keys.pop(id(group), None)
                freed.append(group)
        return freed


def acquire(key: Hashable, lease: Lease, create: Callable[[], Any]) -> tuple[Any, bool, bool]:
    """The registry's communicator for ``key``, created with ``create()`` when none is live.

    Returns ``(group, created, new_to_lease)``: ``created`` when ``create`` ran now;
    ``new_to_lease`` when ``lease`` did not hold it yet (a second request of one layout for the
    same key neither creates nor counts again). A ``create`` that raises leaves the registry
    as it was.
    """
    entry = _entries.get(key)
    if entry is None:
        group = create()
        _entries[key] = _Entry(group, 1)
        _keys[id(group)] = key
        lease._held[key] = group
        return group, True, True
    if key in lease._held:
        return entry.group, False, False
    entry.holders += 1
    lease._held[key] = entry.group
    return entry.group, False, True


def holders(group: Any) -> int:
    """How many leases hold ``group`` (0: not in the registry)."""
    key = _keys.get(id(group))
    entry = None if key is None else _entries.get(key)
    return 0 if entry is None or entry.group is not group else entry.holders


def held(group: Any) -> bool:
    """Whether some live layout still holds ``group`` through the registry (then it must not be destroyed)."""
    return holders(group) > 0


def forget(groups: Iterable[Any]) -> None:
    """Drop ``groups`` from the registry (aborted or destroyed elsewhere); leases then skip them."""
    for group in groups:
        key = _keys.pop(id(group), None)
        entry = None if key is None else _entries.get(key)
        if entry is not None and entry.group is group:
            del _entries[key]


def clear() -> None:
    """Drop every entry (a new world, or an abort of all the engine's groups)."""
    _entries.clear()
    _keys.clear()


def entries() -> list[tuple[Hashable, Any, int]]:
    """``(key, communicator, holders)`` for every live registry communicator, oldest first."""
    return [(key, entry.group, entry.holders) for key, entry in _entries.items()]
