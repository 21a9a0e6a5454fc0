"""Aborting every process group the engine created: no collective, no store wait, bounded time.

When a rank has died or stopped, a destroy that synchronizes with the group's members (a
barrier, a store wait) can hang or wait out a timeout. :func:`abort_groups` instead aborts each
live group the engine created in this process (every group made through
:func:`parallel_state_ng.groups.creation.new_member_group`: compat's state, grids, handles'
CPU groups, Megatron groups, topologies) and removes it from torch's registries, talking to
no peer and no store. It returns in milliseconds whatever the peers do; afterwards the owners'
``destroy()`` / ``destroy_model_parallel()`` find their groups gone and succeed at once.

What torch 2.13 offers, and its limits (measured with gloo on CPU):

* ``ProcessGroup.abort()`` exists for gloo and returns at once with dead and with stopped
  (``SIGSTOP``) peers. It does **not** wake a collective already blocked in another thread on
  a stopped peer: that call stays blocked until the group's own timeout. A dead peer (process
  gone) is different: gloo raises "Connection closed by peer" in the blocked collective at
  once, so detection of a *dead* rank in training costs nothing.
* ``torch.distributed.distributed_c10d._abort_process_group(group)`` aborts and unregisters
  one group (documented as NCCL-only, works for gloo: it asks for the CUDA backend and treats
  its absence as "none"); ``_abort_process_group()`` with no group aborts every group in
  torch's registry and the default group.
* ``destroy_process_group`` of a gloo group (``shutdown``) returns at once with dead or
  stopped peers, so torch's own teardown (nvidia-resiliency-ext's ``AbortTorchDistributed``
  destroys the default group, hence every group) does not hang on gloo either.
* NCCL (GPUs) needs the abort proper: ``shutdown`` may wait for pending work; ``abort()``
  is what ``AbortTorchDistributed`` calls. :func:`abort_groups` calls ``abort()`` on every
  backend.
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

    Returns False when the group was no longer registered (aborted or destroyed elsewhere).
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
            world_aborted = True
        except Exception as exc:  # noqa: BLE001 - fall back to torch's destroy (no wait for gloo)
            errors.append(f"{type(exc).__name__}: {exc}")
            dist.destroy_process_group()
            world_aborted = True
    return AbortResult(aborted, gone, tuple(errors), world_aborted, time.monotonic() - start)
