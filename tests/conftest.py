"""Shared pytest fixtures: simulated ranks (fake backend) and helpers."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for _p in (ROOT, TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)


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


@pytest.fixture(scope="session")
def gloo_world():
    """Return ``get(world_size)``: a persistent :class:`tests._mp.GlooWorld`, one per size.

    Worlds are shared by all tests of one pytest(-xdist) worker process and closed at the end
    of the session; a world that failed (timeout, dead worker) is replaced on the next get.
    """
    from _mp import GlooWorld

    worlds: dict[int, GlooWorld] = {}

    def get(world_size: int) -> GlooWorld:
        world = worlds.get(world_size)
        if world is None or world.closed:
            world = worlds[world_size] = GlooWorld(world_size)
        return world

    yield get
    for world in worlds.values():
        world.close()
