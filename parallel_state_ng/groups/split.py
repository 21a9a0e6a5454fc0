"""Which creation path a build takes, and the split path's one primitive.

With a lazy default group every group is created by its members only
(:func:`~parallel_state_ng.groups.creation.new_member_group`). When the default group splits
(a bound device on a backend that supports splitting, or torchcomms), torch makes each new
communicator by splitting the default one, which every rank of the world must join: then a
build makes one :func:`split_member` call per group kind, on every rank, members with their
group and the others without a colour. See docs/results/gpus.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import torch.distributed as dist

from parallel_state_ng.groups import creation, liveness, nonblocking
from parallel_state_ng.layout.bounded_input import shown

__all__ = [
    "ENV_CREATION_PATH",
    "ENV_SPLIT_SHARE",
    "CreationPath",
    "MemberPathRefusedError",
    "creation_path",
    "world_splits",
    "split_member",
]

#: Environment variable: ``auto`` (default), ``member`` or ``split``; the argument of a builder wins.
ENV_CREATION_PATH = "PSNG_CREATION_PATH"
#: A removed environment variable: it set ``config.split_share`` on each split's own options,
#: which NCCL never reads for sharing (the parent's config decides), so it saved nothing; set to
#: anything but ``0`` it is refused (docs/results/gpus.md, "Split sharing").
ENV_SPLIT_SHARE = "PSNG_NCCL_SPLIT_SHARE"
CreationPath = Literal["member", "split"]
_CHOICES = ("auto", "member", "split")
# Splits joined in the current world (names their arrival marks); reset with a new world.
_splits = [0]
creation.on_new_world(lambda: _splits.__setitem__(0, 0))


class MemberPathRefusedError(ValueError):
    """The member path was asked for on a world whose default group splits (it would hang)."""


def world_splits() -> bool:
    """Whether torch creates new groups by splitting the default group's communicator.

    torch's own condition (``distributed_c10d._new_process_group_helper``): the default group
    has a bound device and a backend for it that supports splitting; or torchcomms is on, where
    member-only creation is not implemented.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    c10d: Any = dist.distributed_c10d
    torchcomms = getattr(c10d, "_use_torchcomms_enabled", None)
    if torchcomms is not None and torchcomms():
        return True
    default = c10d._get_default_group()
    split_source = getattr(c10d, "_get_split_source", None)  # torch internals; absent: no split path
    if getattr(default, "bound_device_id", None) is None or split_source is None:
        return False
    return split_source(default) is not None


def creation_path(requested: str | None = None) -> CreationPath:
    """The path a build takes: ``requested``, else ``$PSNG_CREATION_PATH``, else the world's.

    ``auto`` follows :func:`world_splits`. ``member`` is for a lazy default group only: on a
    world that splits, every new NCCL group is a split of the default group that every rank must
    join, so member-only creation would hang the members of any group a rank is not in; it is
    refused before any group is created.

    Raises:
        ValueError: ``requested`` or the environment variable is not ``auto``, ``member`` or
            ``split``; or the removed ``PSNG_NCCL_SPLIT_SHARE`` is set.
        MemberPathRefusedError: ``member`` was asked for and the default group splits.
        NonblockingBoundError: the split path with nonblocking NCCL init whose wait the
            failure bound cannot hold (:mod:`~parallel_state_ng.groups.nonblocking`).
    """
    _refuse_split_share()
    if requested is None:
        value, where = os.environ.get(ENV_CREATION_PATH, "auto").strip().lower() or "auto", ENV_CREATION_PATH
    else:
        value, where = requested, "creation_path"
    if value not in _CHOICES:
        raise ValueError(f"{where} must be one of {', '.join(_CHOICES)}, got {shown(value)}")
    if value == "auto":
        value = "split" if world_splits() else "member"
    elif value == "member" and world_splits():
        raise MemberPathRefusedError(_member_refusal(where))
    if value == "split":  # a build starts here: refused before any group when torch's wait is unbounded
        nonblocking.check_nonblocking_bound()
    return value  # type: ignore[return-value]


def _refuse_split_share() -> None:
    """Raise when the removed :data:`ENV_SPLIT_SHARE` is set (to anything but ``0``)."""
    text = os.environ.get(ENV_SPLIT_SHARE, "").strip()
    if text not in ("", "0"):
        raise ValueError(
            f"environment variable {ENV_SPLIT_SHARE}={shown(text)} was removed: it set split_share on each split's own "
            f"NCCL options, but NCCL shares a split's resources only when the parent communicator (the default "
            f"group's) was made with splitShare, so it saved nothing (measured on an H200: the same memory with and "
            f"without). Unset it; for NCCL's sharing set NCCL_COMM_SPLIT_SHARE_RESOURCES=1 in every rank's "
            f"environment before init_process_group (docs/results/gpus.md, 'Split sharing')"
        )


def _member_refusal(where: str) -> str:
    default: Any = dist.distributed_c10d._get_default_group()
    device = getattr(default, "bound_device_id", None)
    how = f"bound to {device}" if device is not None else "torchcomms"
    setting = f"{ENV_CREATION_PATH}=member" if where == ENV_CREATION_PATH else "creation_path='member'"
    return (
        f"{setting}: the default process group splits (backend {dist.get_backend()}, {how}): torch makes every "
        f"new group by splitting it, which every rank of the world must join, so creating groups by their "
        f"members only would hang (measured on NCCL: 8 ranks, none finished). Use 'auto' or 'split', or "
        f"init_process_group without device_id for the member path"
    )


def split_member(
    ranks: Sequence[int] | None,
    *,
    context: liveness.CreationContext | None = None,
    backend: str | None = None,
    **kwargs: Any,
) -> Any:
    """Join one split of the default group: this rank's group over ``ranks``, or none (``None``).

    Every rank of the world calls it once per group kind, in the same order; a member passes
    its group's global ranks, a rank in no group of the kind passes ``None`` and gets ``None``.
    Each rank hands torch only its own group: O(group size), never the world's groups.
    ``backend`` (``None``: the parent's) and ``kwargs`` (``timeout``, ``pg_options``,
    ``group_desc``) go to ``torch.distributed.split_group``. A group made is tracked for abort
    and destroy. A build passes its :class:`~parallel_state_ng.groups.liveness.CreationContext`
    (``context``).

    With failure detection on, the split runs under the failure bound (as a gloo group's
    creation does) and a rank that never joins makes the others raise
    :class:`~parallel_state_ng.groups.liveness.RankFailureError` naming it. The bound is the
    split's ``timeout``; torch bounds its waits for a nonblocking NCCL communicator
    (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``) by ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` instead, which
    must then hold the bound: checked before the split
    (:func:`~parallel_state_ng.groups.nonblocking.check_nonblocking_bound`).

    Raises:
        NonblockingBoundError: nonblocking NCCL whose wait the failure bound cannot hold.
    """
    if not hasattr(dist, "split_group"):
        import torch

        from parallel_state_ng.groups.torch_support import TORCH_FACTS

        raise RuntimeError(
            f"the split creation path needs torch.distributed.split_group (torch "
            f"{TORCH_FACTS['split_group'][0]}+, parallel_state_ng.groups.torch_support); "
            f"torch {torch.__version__} has none: "
            f"use the member path (creation path 'member', PSNG_CREATION_PATH=member)"
        )
    nonblocking.check_nonblocking_bound()  # before this rank's first split: torch's wait must hold the bound
    if context is None:  # a build that passes its context synchronized the world when it started
        creation.sync_world()
    world = dist.get_world_size()
    if ranks is None:
        if world == 1:
            return None  # no other rank to split with
        # torch joins a rank to no colour when the first listed split does not hold it
        split_ranks = [[(dist.get_rank() + 1) % world]]
    else:
        split_ranks = [list(ranks)]
    if backend is not None:
        kwargs["backend"] = backend
    name = f"psng-split-{_splits[0]}"  # every rank makes the same splits: the same names
    _splits[0] += 1
    group = liveness.guarded_create(
        lambda kw: dist.split_group(None, split_ranks, **kw), range(world), name, kwargs, context, collective=True
    )
    return creation.track_group(group) if ranks is not None else None
