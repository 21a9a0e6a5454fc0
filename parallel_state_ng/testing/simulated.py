"""One simulated rank of any world: torch's fake backend in this process (and the argument checks
the worlds share).

:func:`simulated_rank` (a context manager) and :func:`init_simulated_rank` make this process rank
``rank`` of a ``world_size``-rank world: no peers, no processes, any size. Groups are created as
on a real rank and collectives do nothing. Public through :mod:`parallel_state_ng.testing.worlds`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any


def check_int(name: str, value: Any, low: int, high: int | None = None, high_name: str = "") -> int:
    """``value`` as an int in ``[low, high)``; a TypeError / ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high_name}={high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a positive, finite number of seconds; an error naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")
    return float(value)


def _existing(dist: Any) -> str:
    """The default process group that exists, described."""
    return (
        f"a default process group already exists (backend {dist.get_backend()!r}, rank {dist.get_rank()} "
        f"of {dist.get_world_size()})"
    )


def init_simulated_rank(rank: int, world_size: int, *, replace: bool = False) -> None:
    """Initialize the default process group as rank ``rank`` of a ``world_size``-rank fake world.

    The caller destroys it (``torch.distributed.destroy_process_group()``); :func:`simulated_rank`
    does that for a ``with`` block. ``replace=True`` first destroys any default group (and every
    group made over it); otherwise an existing default group is refused.

    Raises:
        TypeError, ValueError: ``rank`` or ``world_size`` is not an int, ``world_size < 1``, or
            ``rank`` is outside ``[0, world_size)``.
        RuntimeError: a default process group exists and ``replace`` is false.
    """
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, world_size, "world_size")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if not replace:
            raise RuntimeError(
                f"{_existing(dist)}: destroy it first (torch.distributed.destroy_process_group()) or pass replace=True"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int) -> Iterator[Any]:
    """This process is rank ``rank`` of a ``world_size``-rank world (fake backend) inside the block.

    Yields the default process group. On exit the default group and every group made over it
    are destroyed, whatever the block did. A default group that exists before the block is
    refused (RuntimeError): the block would destroy a group it did not make.

        with simulated_rank(5, 8):
            assert torch.distributed.get_rank() == 5

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`init_simulated_rank` without ``replace``.
    """
    import torch.distributed as dist

    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, world_size, "world_size")
    if dist.is_initialized():
        raise RuntimeError(
            f"simulated_rank({rank}, {world_size}) would destroy a group it did not make: {_existing(dist)}; "
            "destroy it first (torch.distributed.destroy_process_group())"
        )
    init_simulated_rank(rank, world_size)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
