"""The multi-process gloo harness itself: results by rank, errors carried back."""

import pytest
import torch
import torch.distributed as dist

from tests.support.worlds.gloo import WorkerError


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom")
    return "ok"


def test_all_reduce_over_world(gloo_world):
    world = gloo_world(4)
    assert world.run(_sum_of_ranks) == [6.0] * 4


def test_worker_error_is_reported_and_world_reusable(gloo_world):
    world = gloo_world(4)
    with pytest.raises(WorkerError) as info:
        world.run(_fail_on_rank_one)
    assert list(info.value.errors) == [1] and info.value.errors[1][0] == "ValueError"
    assert world.run(_sum_of_ranks) == [6.0] * 4
