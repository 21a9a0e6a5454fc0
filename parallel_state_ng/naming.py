"""Creating a process group with only its members, under a name all members agree on.

``torch.distributed.new_group(..., use_local_synchronization=True)`` lets the members alone
create a group, but torch names such a group after its ranks *and the number of groups the
calling process already has*. Ranks that belong to different numbers of groups (a rank on the
first pipeline stage holds an embedding group, its neighbour does not) then compute different
names for their next common group, look for each other under different store prefixes, and
wait until the timeout.

:func:`new_member_group` names a group after what every member does know: its rank list and
how many groups with exactly that rank list this process created before (every member takes
part in each creation of a group over it, so that count is the same on all of them).
Names are never reused, so a re-created group never meets keys left in the store by an earlier
one. :func:`destroy_groups` destroys groups and drops the per-name tag entry torch leaves
behind, so repeated create/destroy cycles leave no trace in torch's registries.

The per-set counters are process-wide because torch's group registry is process-wide; they
carry no layout state.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["new_member_group", "member_set_digest", "destroy_groups"]

_created_by_member_set: dict[str, int] = {}


def member_set_digest(ranks: Sequence[int]) -> str:
    """A short digest of the rank list (O(len(ranks)), one 8-byte-per-rank buffer)."""
    return hashlib.sha1(array("q", ranks), usedforsecurity=False).hexdigest()[:24]


def new_member_group(ranks: Sequence[int], **kwargs: Any):
    """``new_group(ranks, use_local_synchronization=True, **kwargs)`` under a stable name.

    Only the members call it, with the same rank list (same order); each member must create
    its groups over a given rank list in the same sequence (true for SPMD code). A gloo group
    is ready on every member when this returns (one barrier over it), so it may be destroyed
    right away. Other keyword arguments (``timeout``, ``backend``, ``pg_options``,
    ``group_desc``) go to ``torch.distributed.new_group``.
    """
    if not isinstance(ranks, list):
        ranks = list(ranks)
    digest = member_set_digest(ranks)
    count = _created_by_member_set.get(digest, 0)
    name = f"psng-{digest}-{count}"
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is not None:
        c10d._process_group_name = lambda _ranks, use_hashed_name=False: name
    try:
        group = dist.new_group(ranks=ranks, use_local_synchronization=True, **kwargs)
    finally:
        if original is not None:
            c10d._process_group_name = original
    _created_by_member_set[digest] = count + 1
    if isinstance(group, dist.ProcessGroup) and len(ranks) > 1 and dist.get_backend(group) == "gloo":
        # gloo connects every pair eagerly; a member that returned early and destroyed the
        # group at once would close sockets a slower member is still connecting. A barrier
        # here means: when creation returns, every member has finished connecting.
        dist.barrier(group=group)
    return group


def destroy_groups(groups: Iterable[Any]) -> int:
    """Destroy each live process group in ``groups`` once; return how many were destroyed.

    ``None`` entries, groups already destroyed and repeats are skipped. Besides
    ``torch.distributed.destroy_process_group``, this removes the now empty
    ``ptd:<group name>`` tag list torch keeps for every named group.
    """
    if not dist.is_initialized():
        return 0
    world = dist.distributed_c10d._world
    done = 0
    seen: set[int] = set()
    for pg in groups:
        if pg is None or id(pg) in seen or pg not in world.pg_map:
            continue
        seen.add(id(pg))
        tag = world.pg_to_tag.get(pg)
        dist.destroy_process_group(pg)
        if tag and tag.startswith("ptd:") and not world.tags_to_pg.get(tag, True):
            del world.tags_to_pg[tag]
        done += 1
    return done
