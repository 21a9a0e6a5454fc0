"""Shared pytest fixtures: simulated ranks (fake backend) and helpers."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def fake_world():
    """Return ``init(rank, world_size)`` that (re)initializes a fake-backend world.

    The default process group is destroyed after the test, so tests stay independent.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
