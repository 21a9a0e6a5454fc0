"""Rejoining the survivors after a rank died: shrink the default group in place, or re-initialize.

After the survivors agreed on the dead (:func:`~parallel_state_ng.groups.liveness.agree_on_survivors`)
and planned the new layout (:func:`~parallel_state_ng.layout.rebuild.plan_rebuild`),
:func:`rejoin` gives them the plan's new default group. Where torch and the backend can shrink
(``torch.distributed.shrink_group``, NCCL's ``ncclCommShrink``), the old default group is
shrunk: no new rendezvous, no new store, and on a bound device the layout's groups are then
split from the shrunk group. Elsewhere (gloo, a torch without ``shrink_group``) the survivors
initialize a new default group over a fresh prefix of the old store, as before. The choice
(:func:`choose_recovery`) is logged. See docs/reliability.md ("Recovery in place").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from parallel_state_ng.groups import abort, creation
from parallel_state_ng.groups.torch_support import TORCH_FACTS
from parallel_state_ng.layout.bounded_input import shown

__all__ = [
    "ENV_RECOVERY",
    "RecoveryMethod",
    "RecoveryChoice",
    "Rejoined",
    "shrink_support",
    "choose_recovery",
    "keeps_order",
    "rejoin",
]

#: Environment variable: ``auto`` (default: shrink where possible), ``shrink`` or ``reinit``.
ENV_RECOVERY = "PSNG_RECOVERY"
RecoveryMethod = Literal["shrink", "reinit"]
_CHOICES = ("auto", "shrink", "reinit")
#: Where the new world's keys go in the old store (names count from 0 again in a new world).
_PREFIX = "psng-recovery"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryChoice:
    """How the survivors rejoin (``method``) and why (``reason``, also logged)."""

    method: RecoveryMethod
    reason: str


@dataclass(frozen=True)
class Rejoined:
    """What :func:`rejoin` did on this rank.

    ``rank`` and ``world_size`` are the new world's (``rank`` ``None``: this survivor is not in
    the new world; it aborted every group and holds no default group). ``seconds``: the shrink
    or the re-initialization alone (aborting the old groups excluded).
    """

    method: RecoveryMethod
    reason: str
    rank: int | None
    world_size: int
    seconds: float


def shrink_support() -> str | None:
    """Why the default group cannot be shrunk here (``None``: it can).

    Needs ``torch.distributed.shrink_group`` (TORCH_FACTS) and a default-group backend that
    says it supports shrinking (NCCL's ``ncclCommShrink``; gloo does not).
    """
    if not hasattr(dist, "shrink_group"):
        added = TORCH_FACTS["shrink_group"][0]
        return f"torch {torch.__version__} has no torch.distributed.shrink_group (added in {added})"
    if not dist.is_initialized():
        return "torch.distributed is not initialized"
    default: Any = dist.distributed_c10d._get_default_group()
    device = getattr(default, "bound_device_id", None) or torch.device("cpu")
    try:
        backend = default._get_backend(device)
        supported = bool(backend.supports_shrinking)
    except Exception:  # noqa: BLE001 - no backend for the device, or no such property
        supported = False
    if not supported:
        return f"the default group's {dist.get_backend()} backend on {device} cannot shrink"
    return None


def choose_recovery(
    requested: str | None = None, *, shrink: Callable[..., Any] | None = None, keeps_order: bool = True
) -> RecoveryChoice:
    """The recovery method: ``requested``, else ``$PSNG_RECOVERY``, else ``auto``; logged at INFO.

    ``auto`` shrinks when :func:`shrink_support` allows it (or a ``shrink`` stand-in is given)
    and the plan keeps the survivors in their old order (``keeps_order``: torch numbers a
    shrunk group's ranks in their old order), else re-initializes.

    Raises:
        ValueError: ``requested`` or the environment variable is not ``auto``, ``shrink`` or ``reinit``.
        RuntimeError: ``shrink`` was requested where it is not possible (the message says why).
    """
    if requested is None:
        value, where = os.environ.get(ENV_RECOVERY, "auto").strip().lower() or "auto", ENV_RECOVERY
    else:
        value, where = requested, "method"
    if value not in _CHOICES:
        raise ValueError(f"{where} must be one of {', '.join(_CHOICES)}, got {shown(value)}")
    if value == "reinit":
        choice = RecoveryChoice("reinit", f"{where}=reinit")
    else:
        why_not = None if shrink is not None else shrink_support()
        if why_not is None and not keeps_order:
            why_not = "the plan renumbers the survivors out of their old order (spares kept, or keep_data_parallel)"
        if why_not is None:
            choice = RecoveryChoice("shrink", "shrink_group: the default group shrinks in place")
        elif value == "shrink":
            raise RuntimeError(f"{where}=shrink, but the default group cannot be shrunk here: {why_not}")
        else:
            choice = RecoveryChoice("reinit", f"re-initializing over a new store prefix: {why_not}")
    log.info("recovery over the survivors: %s (%s)", choice.method, choice.reason)
    return choice


def keeps_order(plan: Any) -> bool:
    """Whether ``plan`` (a :class:`~parallel_state_ng.layout.rebuild.RebuildPlan`) keeps its ranks' old order.

    torch numbers a shrunk group's ranks in their old order: the shrink path needs the same.
    """
    kept = plan.new_rank[plan.new_rank >= 0]
    return bool((kept == torch.arange(len(kept))).all())


def rejoin(
    plan: Any,
    *,
    rank: int,
    epoch: int,
    method: str | None = None,
    shrink: Callable[..., Any] | None = None,
    timeout: timedelta | None = None,
) -> Rejoined:
    """Give this survivor the default group of ``plan``'s new world (every survivor calls it).

    ``rank``: this process's rank in the old world; ``epoch``: which recovery this is (every
    survivor passes the same; it names the new world's store prefix). ``method``: see
    :func:`choose_recovery`. ``shrink``: stands in for ``torch.distributed.shrink_group``
    (tests). The engine's groups are aborted first (no wait on the dead); then either the
    default group is shrunk to the survivors the plan keeps, or, with ``reinit``, the old default
    group is aborted and a new one initialized (same backend and bound device) over
    ``PrefixStore("psng-recovery/<epoch>/", old store)``. Either way the new world's keys get
    that prefix, so names counted from 0 again never meet the old world's keys. A survivor the
    plan leaves out aborts everything and gets ``rank=None``. Build the layout afterwards with
    ``build_megatron_groups(**plan.build_kwargs)`` or ``initialize_model_parallel(**plan.initialize_kwargs)``.

    Raises:
        ValueError: ``rank`` is not a survivor of the plan's old world; a bad ``method``.
        RuntimeError: ``method="shrink"`` where the group cannot shrink.
    """
    if not 0 <= rank < plan.old_world_size or rank in plan.failed:
        raise ValueError(f"rank {rank} is not a survivor of the old world of {plan.old_world_size} ranks")
    new_rank = plan.new_rank_of(rank)
    choice = choose_recovery(method, shrink=shrink, keeps_order=keeps_order(plan))
    c10d: Any = dist.distributed_c10d
    default = c10d._get_default_group()
    backend, store = str(dist.get_backend()), c10d._get_default_store()
    device = getattr(default, "bound_device_id", None)
    if new_rank is None:
        abort.abort_groups(world=True)
        return Rejoined(choice.method, choice.reason, None, plan.world_size, 0.0)
    abort.abort_groups(world=choice.method == "reinit")
    start = time.monotonic()
    prefix = f"{_PREFIX}/{epoch}/"
    if choice.method == "shrink":
        leaving = torch.nonzero(plan.new_rank < 0).flatten().tolist()
        # SHRINK_ABORT: a rank died, so the parent's pending work is aborted, not waited for
        flags = getattr(c10d, "SHRINK_ABORT", 1)
        group = (shrink or dist.shrink_group)(sorted(leaving), shrink_flags=flags)
        world = c10d._world
        kind, group_store = world.pg_map[group]
        world.pg_map[group] = (kind, dist.PrefixStore(prefix, group_store))
    else:
        extra = {} if device is None else {"device_id": device}
        if timeout is not None:
            extra["timeout"] = timeout
        dist.init_process_group(
            backend, rank=new_rank, world_size=plan.world_size, store=dist.PrefixStore(prefix, store), **extra
        )
    creation.sync_world()
    seconds = time.monotonic() - start
    if (dist.get_rank(), dist.get_world_size()) != (new_rank, plan.world_size):
        raise RuntimeError(
            f"rank {rank}: the new world made me rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"the plan says {new_rank} of {plan.world_size}"
        )
    return Rejoined(choice.method, choice.reason, new_rank, plan.world_size, seconds)
