"""A gloo stand-in for ``torch.distributed.shrink_group``, so that CPU processes take the shrink path.

:func:`gloo_shrink` does what torch's shrink of the default group does, on gloo, which cannot
shrink: every other group is dropped and the survivors get a new default group, numbered in
their old order, which the caller then finds as the default group. Unlike NCCL's
``ncclCommShrink`` it meets the survivors again through the old default store (under its own
prefix). Calls are counted in :data:`calls`. See docs/reliability.md ("Recovery in place").
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

#: (ranks excluded, shrink_flags) of every call in this process.
calls: list[tuple[list[int], int]] = []


def gloo_shrink(ranks_to_exclude: list[int], group: Any = None, shrink_flags: int = 0, pg_options: Any = None) -> Any:
    """Shrink the default group to the ranks not in ``ranks_to_exclude``; return the new default group."""
    assert group is None, "the engine shrinks the default group"
    c10d: Any = dist.distributed_c10d
    store = c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    excluded = set(ranks_to_exclude)
    assert rank not in excluded, "an excluded rank never calls shrink_group"
    remaining = [r for r in range(world) if r not in excluded]
    calls.append((sorted(excluded), shrink_flags))
    c10d._abort_process_group()  # the default group and every other group, without waiting
    prefix = dist.PrefixStore(f"stand-in-shrink/{len(calls)}/", store)
    dist.init_process_group("gloo", rank=remaining.index(rank), world_size=len(remaining), store=prefix)
    return c10d._get_default_group()
