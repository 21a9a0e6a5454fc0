"""``agree_on_survivors``: the ranks that still answer, found through a store (one process)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from parallel_state_ng.groups.liveness import agree_on_survivors


def test_every_rank_marked_returns_the_whole_world_at_once():
    store = dist.HashStore()
    for r in (1, 2, 3):
        store.set(f"psng-alive/0/{r}", "")
    start = time.monotonic()
    assert agree_on_survivors(store, 0, 4, wait_s=5.0) == [0, 1, 2, 3]
    assert time.monotonic() - start < 2.0  # no waiting when every mark is there


def test_missing_marks_are_the_dead_after_the_wait():
    store = dist.HashStore()
    store.set("psng-alive/0/2", "")
    start = time.monotonic()
    assert agree_on_survivors(store, 0, 4, wait_s=0.3) == [0, 2]
    assert time.monotonic() - start >= 0.25
    # a second failure in the same world: its own epoch, earlier marks do not count
    assert agree_on_survivors(store, 2, 4, wait_s=0.2, epoch=1) == [2]


@pytest.mark.parametrize(("rank", "world", "wait_s", "match"), [(4, 4, 1.0, "rank 4"), (0, 4, 0.0, "wait_s")])
def test_bad_arguments_are_named(rank, world, wait_s, match):
    with pytest.raises(ValueError, match=match):
        agree_on_survivors(dist.HashStore(), rank, world, wait_s=wait_s)
