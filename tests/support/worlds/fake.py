"""A simulated world in this process: torch's fake backend, any rank of any size, no peers."""

from __future__ import annotations

import torch.distributed as dist


def fake_world(rank: int, world_size: int) -> None:
    """(Re)initialize the default process group as a fake-backend world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
