"""A gloo stand-in for NCCL's split, so that real CPU processes can take the split path.

:func:`gloo_split` replaces ``torch.distributed.split_group`` in a worker: like
``ncclCommSplit`` it is collective over every rank of the world (a store round bounded by the
split's timeout), then the members connect their gloo group. With torch's nonblocking NCCL
mode on (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``) the round is bounded as torch bounds a
nonblocking split instead: by ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` whole seconds (1800 when unset),
read once per process, not by the split's timeout. See docs/results/gpus.md.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_joined = [0]
_nonblocking_wait: list[float] = []  # torch reads its nonblocking timeout once per process


def _wait_s(timeout: timedelta | None) -> float:
    """How long the round may wait: the split's timeout, or torch's nonblocking wait."""
    import os

    if os.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING") != "1":
        return timeout.total_seconds() if timeout else 1800.0
    if not _nonblocking_wait:
        text = os.environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "").strip()
        _nonblocking_wait.append(float(int(text)) if text else 1800.0)
    return _nonblocking_wait[0] + 1.0  # torch compares whole seconds: elapsed > T


def gloo_split(parent_pg: Any = None, split_ranks: list | None = None, timeout: timedelta | None = None, **kwargs: Any):
    """One split of the default group: every rank joins; a member gets its gloo group, others ``None``."""
    from parallel_state_ng.groups.creation import new_member_group

    assert parent_pg is None and split_ranks, "the engine splits the default group"
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"stand-in-split/{_joined[0]}"
    _joined[0] += 1
    store.add(key, 1)
    deadline = time.monotonic() + _wait_s(timeout)
    while int(store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"stand-in split {key}: timed out waiting for the other ranks of the world")
        time.sleep(0.005)
    mine = next((sorted(g) for g in split_ranks if rank in g), None)
    if mine is None:
        return None
    return new_member_group(mine, backend="gloo", timeout=timeout, group_desc=kwargs.get("group_desc"))


def install() -> None:
    """Make this process's ``torch.distributed.split_group`` the stand-in."""
    module: Any = dist  # the stand-in's signature is looser than torch's
    module.split_group = gloo_split
