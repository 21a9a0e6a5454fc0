"""Creating a process group with only its members, under a name all members agree on.

:func:`new_member_group` names a group after its rank list and how many groups over that list
this process made before (torch's own name also counts the process's other groups, which
differ between ranks). :func:`destroy_groups` first waits, bounded, for every member of a gloo
group to finish creating it. :func:`live_groups` is the process-wide registry
:mod:`parallel_state_ng.groups.abort` aborts; a new default process group resets names and
registries. See docs/engine.md (group names) and docs/reliability.md.
"""

from __future__ import annotations

import atexit
import hashlib
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from parallel_state_ng.groups import liveness, registry
from parallel_state_ng.groups.torch_support import torch_has

__all__ = [
    "new_member_group",
    "member_set_digest",
    "destroy_groups",
    "track_group",
    "live_groups",
    "is_tracked",
    "forget_groups",
    "mark_dead",
    "on_new_world",
    "sync_world",
    "creation_round",
    "ENV_SETTLE_TIMEOUT",
]

#: Environment variable: the most seconds :func:`destroy_groups` waits for the members of a gloo
#: group to finish creating it (default 30).
ENV_SETTLE_TIMEOUT = "PSNG_DESTROY_SETTLE_TIMEOUT"
_READY_PREFIX = "psng-ready/"

_created_by_member_set: dict[str, int] = {}
# Gloo groups made here whose members' readiness marks were not yet seen:
# name -> (group size, time.monotonic() at creation).
_unsettled: dict[str, tuple[int, float]] = {}
# Every group made here and not destroyed through destroy_groups, in creation order: id -> group.
_live: dict[int, Any] = {}
# Global ranks known to be dead in the current world (never waited for).
_dead: set[int] = set()
# The default group the registries above belong to, and what to reset when it changes.
_world_of_state: list[Any] = [None]
_new_world_callbacks: list[Any] = []
# > 0 while groups are made inside a creation_round (no readiness marks).
_rounds_open: list[int] = [0]
# Torch before 2.8 (TORCH_FACTS pg_destructor_releases_gil): the backends of the groups the last
# destroy_groups call destroyed. Their ProcessGroup objects, when freed by their last holder (often
# the caller's code, right after a collective), then do not destroy the backend under the GIL;
# the backends are freed here, where torch releases the GIL first: at the next call, or at exit.
_kept_backends: list[Any] = []


def _keep_backends(pg: Any) -> None:
    for device_type in getattr(pg, "_device_types", ()):
        try:
            _kept_backends.append(pg._get_backend(torch.device(device_type)))
        except Exception:  # noqa: BLE001 - no backend for that device: nothing to keep
            pass


@atexit.register
def _free_kept_backends() -> None:
    # While the interpreter is whole: a backend freed during finalization cannot take the GIL.
    _kept_backends.clear()


@contextmanager
def creation_round(covered: bool) -> Iterator[None]:
    """Groups made inside get no readiness mark when ``covered`` (docs/reliability.md).

    ``covered`` says that the block ends with a round every member of every group made in it
    takes part in, after its last creation (a closing round), so no member can destroy a
    group another member is still connecting through. With ``covered=False`` nothing changes.
    """
    if not covered:
        yield
        return
    _rounds_open[0] += 1
    try:
        yield
    finally:
        _rounds_open[0] -= 1


def on_new_world(callback: Any) -> None:
    """Call ``callback()`` whenever a new default process group is seen (per-world state resets)."""
    _new_world_callbacks.append(callback)


def sync_world() -> None:
    """Drop the registries and name counters of an earlier default group.

    Names count from 0 again in a new world (an in-process restart), so it needs a fresh store
    or store prefix, as torch's own group names do (docs/reliability.md).
    """
    default = dist.distributed_c10d._world.default_pg
    if default is _world_of_state[0]:
        return
    _world_of_state[0] = default
    _created_by_member_set.clear()
    _unsettled.clear()
    _live.clear()
    _dead.clear()
    registry.clear()
    liveness.reset_world_state()
    for callback in _new_world_callbacks:
        callback()


def track_group(group: Any) -> Any:
    """Record ``group`` (made by this process, e.g. with a plain ``new_group``) as live; return it."""
    if isinstance(group, dist.ProcessGroup):
        sync_world()
        _live[id(group)] = group
    return group


def is_tracked(group: Any) -> bool:
    """Whether ``group`` was made through this module (or :func:`track_group`) and is live (O(1))."""
    return id(group) in _live


def live_groups() -> list[Any]:
    """The groups made through this module (or :func:`track_group`) and not yet destroyed here."""
    return list(_live.values())


def forget_groups(groups: Iterable[Any]) -> None:
    """Drop ``groups`` from the registries without touching them (they were aborted or destroyed elsewhere)."""
    names = dist.distributed_c10d._world.pg_names
    groups = list(groups)
    registry.forget(groups)
    for pg in groups:
        _live.pop(id(pg), None)
        name = names.get(pg)
        if name is not None:
            _unsettled.pop(name, None)


def forget_all() -> None:
    """Drop every registry entry (after an abort of all the engine's groups)."""
    _live.clear()
    _unsettled.clear()
    registry.clear()


def mark_dead(ranks: Iterable[int]) -> None:
    """Record global ``ranks`` as dead in the current world: no destroy waits for them.

    :func:`new_member_group` records the ranks a
    :class:`~parallel_state_ng.groups.liveness.RankFailureError` names.
    """
    sync_world()
    _dead.update(int(r) for r in ranks)


def member_set_digest(ranks: Sequence[int]) -> str:
    """A short digest of the rank list (O(len(ranks)), one 8-byte-per-rank buffer)."""
    return hashlib.sha1(array("q", ranks), usedforsecurity=False).hexdigest()[:24]


def new_member_group(ranks: Sequence[int], *, context: liveness.CreationContext | None = None, **kwargs: Any):
    """``new_group(ranks, use_local_synchronization=True, **kwargs)`` under a stable name.

    Only the members call it, with the same rank list (same order); each member must create
    its groups over a given rank list in the same sequence (true for SPMD code). Names are never
    reused, so a re-created group never meets store keys an earlier one left. A gloo group
    may be destroyed right away through :func:`destroy_groups`, which first waits for every
    member to finish creating it (docs/reliability.md). Other keyword arguments
    (``timeout``, ``backend``, ``pg_options``, ``group_desc``) go to
    ``torch.distributed.new_group``. A build that creates many groups passes one
    :class:`~parallel_state_ng.groups.liveness.CreationContext` to all of them (``context``;
    default: read for this group).

    Raises:
        RankFailureError: a member died or stopped before the gloo group was connected; raised
            within :func:`parallel_state_ng.groups.liveness.creation_timeout`, naming it.
    """
    if not isinstance(ranks, list):
        ranks = list(ranks)
    if context is None:  # a build that passes its context synchronized the world when it started
        sync_world()
    digest = member_set_digest(ranks)
    count = _created_by_member_set.get(digest, 0)
    name = f"psng-{digest}-{count}"
    # Any: torch's private namer is swapped for one that returns our name (a plain str).
    c10d: Any = dist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is not None:
        c10d._process_group_name = lambda _ranks, use_hashed_name=False: name
    try:
        group = liveness.guarded_create(
            lambda kw: dist.new_group(ranks=ranks, use_local_synchronization=True, **kw), ranks, name, kwargs, context
        )
    except liveness.RankFailureError as err:
        mark_dead(err.dead)  # no later destroy waits for them
        raise
    finally:
        if original is not None:
            c10d._process_group_name = original
    _created_by_member_set[digest] = count + 1
    if isinstance(group, dist.ProcessGroup):
        _live[id(group)] = group  # track_group, without its second sync_world
        if not _rounds_open[0] and len(ranks) > 1 and "gloo" in str(dist.get_backend(group)):
            _mark_ready(group, name, len(ranks))
    return group


def _group_store(group: Any) -> Any:
    return dist.distributed_c10d._world.pg_map[group][1]


def _mark_ready(group: Any, name: str, size: int) -> None:
    """Leave this member's "creation finished" mark in the group's store (no round trip)."""
    _group_store(group).set(f"{_READY_PREFIX}{dist.get_rank(group)}", b"")
    if len(_unsettled) >= 4096:  # drop groups destroyed elsewhere (e.g. by torch directly)
        live = set(dist.distributed_c10d._world.pg_names.values())
        for stale in [n for n in _unsettled if n not in live]:
            del _unsettled[stale]
    _unsettled[name] = (size, time.monotonic())


def _settle_timeout() -> timedelta:
    return timedelta(seconds=max(liveness.env_seconds(ENV_SETTLE_TIMEOUT, 30.0), 0.001))


def _settle(group: Any, name: str) -> None:
    """Wait (bounded) until every member of a gloo group made here has finished creating it.

    The bound counts from the group's creation; members known to be dead are not waited for.
    """
    entry = _unsettled.pop(name, None)
    if entry is None:
        return
    size, created = entry
    left = _settle_timeout().total_seconds() - (time.monotonic() - created)
    if left <= 0:
        return
    keys = [f"{_READY_PREFIX}{r}" for r in range(size)]
    if _dead:
        ranks = dist.get_process_group_ranks(group)
        keys = [f"{_READY_PREFIX}{i}" for i, r in enumerate(ranks) if r not in _dead]
    try:
        _group_store(group).wait(keys, timedelta(seconds=left))
    except Exception:  # noqa: BLE001 - a member that never marks is dead or failed: closing is safe
        pass


def destroy_groups(groups: Iterable[Any], lease: registry.Lease | None = None) -> int:
    """Destroy each live process group in ``groups`` once; return how many were destroyed.

    ``None`` entries, groups already destroyed and repeats are skipped. A gloo group made by
    :func:`new_member_group` is destroyed only once every member has finished creating it
    (bounded wait, docs/reliability.md); a group destroyed with
    ``torch.distributed.destroy_process_group`` directly gets no such wait. Besides
    ``torch.distributed.destroy_process_group``, this removes the now empty
    ``ptd:<group name>`` tag list torch keeps for every named group. Before torch 2.8 it keeps the
    destroyed groups' backends until its next call (or exit), so that freeing a group object right
    after a collective cannot deadlock in torch's destructor (``pg_destructor_releases_gil``).

    ``lease``: the destroyed layout's hold on the process-wide communicator registry
    (:mod:`parallel_state_ng.groups.registry`), given back first. A group another live layout
    still holds through the registry is skipped (its last holder destroys it).
    """
    if lease is not None:
        lease.release()
    _free_kept_backends()  # the previous call's: no collective runs on them any more
    keep = not torch_has("pg_destructor_releases_gil")
    if not dist.is_initialized():  # the default group (and with it every group) was destroyed
        for pg in groups:
            _live.pop(id(pg), None)
        return 0
    world = dist.distributed_c10d._world
    done = 0
    seen: set[int] = set()
    for pg in groups:
        if pg is None or id(pg) in seen or registry.held(pg):
            continue
        _live.pop(id(pg), None)
        if pg not in world.pg_map:  # destroyed or aborted elsewhere
            continue
        seen.add(id(pg))
        tag = world.pg_to_tag.get(pg)
        name = world.pg_names.get(pg)
        if name in _unsettled:
            _settle(pg, name)
        if keep:
            _keep_backends(pg)
        dist.destroy_process_group(pg)
        if tag and tag.startswith("ptd:") and not world.tags_to_pg.get(tag, True):
            del world.tags_to_pg[tag]
        done += 1
    return done
