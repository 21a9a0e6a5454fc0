"""Aborting every process group the engine created: no collective, no store wait, bounded time.

:func:`abort_groups` aborts and unregisters each live group made through
:func:`parallel_state_ng.groups.creation.new_member_group` (compat's state, grids, handles' CPU
groups, Megatron groups, topologies), talking to no peer and no store; the owners' ``destroy()``
then returns at once. See docs/reliability.md ("Abort without waiting"; what torch 2.13
offers for gloo: docs/results/reliability.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups import creation

__all__ = ["AbortResult", "abort_groups", "abort_group"]


@dataclass(frozen=True)
class AbortResult:
    """What :func:`abort_groups` did: groups aborted, groups already gone, errors swallowed, seconds."""

    aborted: int
    already_gone: int
    errors: tuple[str, ...]
    world_aborted: bool
    elapsed_s: float


def abort_group(group: Any) -> bool:
    """Abort ``group`` and remove it from torch's registries, without waiting for anything.

    Every backend's ``abort()`` is called: NCCL needs it (its ``shutdown`` may wait for pending
    work). Returns False when the group was no longer registered (aborted or destroyed elsewhere).
    Errors of the backend's ``abort()`` are swallowed: the group is unregistered regardless.
    """
    world = dist.distributed_c10d._world
    creation.forget_groups([group])
    if group not in world.pg_map:
        return False
    tag = world.pg_to_tag.get(group)
    try:
        dist.distributed_c10d._abort_process_group(group)
    except Exception:  # noqa: BLE001 - a backend without abort, or one already broken: unregister anyway
        _unregister(group, world, tag)
    if group in world.pg_map:  # torch 2.6 aborts only NCCL groups (TORCH_FACTS "abort_process_group_any_backend")
        _unregister(group, world, tag)
    if tag and tag.startswith("ptd:") and not world.tags_to_pg.get(tag, True):
        del world.tags_to_pg[tag]
    return True


def _unregister(group: Any, world: Any, tag: str | None) -> None:
    """The registry bookkeeping of torch's abort, for when ``_abort_process_group`` itself failed."""
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag):
        table.pop(group, None)
    world.pg_coalesce_state.pop(group, None)
    for key in (tag, "") if tag and tag.startswith("ptd:") else (tag,):
        members = world.tags_to_pg.get(key) if key is not None else None
        if members is not None and group in members:
            members.remove(group)
    try:
        dist.distributed_c10d._unregister_process_group(group.group_name)
    except Exception:  # noqa: BLE001 - not registered under that name, or already gone
        pass


def abort_groups(*, world: bool = False) -> AbortResult:
    """Abort every live group the engine created in this process; no collective, no store wait.

    The newest group goes first. Afterwards the engine's registries are empty; the objects
    that held the groups (compat's state, grids, ``MegatronGroups``, topologies) can still be
    destroyed, which then does nothing and returns at once.

    Args:
        world: also abort every other group in torch's registry and the default group
            (torch's ``_abort_process_group()``), as an in-process restart needs before
            ``init_process_group`` can run again.

    Returns:
        An :class:`AbortResult`.
    """
    start = time.monotonic()
    aborted = gone = 0
    errors: list[str] = []
    if dist.is_available() and dist.is_initialized():
        for group in reversed(creation.live_groups()):
            try:
                if abort_group(group):
                    aborted += 1
                else:
                    gone += 1
            except Exception as exc:  # noqa: BLE001 - abort must go on with the other groups
                errors.append(f"{type(exc).__name__}: {exc}")
    else:
        gone = len(creation.live_groups())
    creation.forget_all()
    world_aborted = False
    if world and dist.is_available() and dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
            if dist.is_initialized():  # torch 2.6 aborts only NCCL (TORCH_FACTS "abort_process_group_any_backend")
                dist.destroy_process_group()
            world_aborted = True
        except Exception as exc:  # noqa: BLE001 - fall back to torch's destroy (no wait for gloo)
            errors.append(f"{type(exc).__name__}: {exc}")
            dist.destroy_process_group()
            world_aborted = True
    return AbortResult(aborted, gone, tuple(errors), world_aborted, time.monotonic() - start)
