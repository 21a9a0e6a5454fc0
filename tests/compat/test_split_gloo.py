"""The split path on real processes: 4 gloo ranks with a stand-in for NCCL's split.

``PSNG_CREATION_PATH=split`` forces the path; ``tests.support.worlds.split_stand_in`` makes each
split collective over the world, as ``ncclCommSplit`` is. The groups work (all-reduce), equal
the member path's, and destroy leaves none; a rank that disagrees raises on every rank; a rank
that dies between two splits makes every survivor raise within the failure bound, naming it.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support.worlds.failure import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD = 4
BOUND = "4"
ENV = {"PSNG_FAILURE_TIMEOUT": BOUND, "PSNG_CREATION_PATH": "split"}


def init_and_check(rank: int, directory: str, tp: int) -> dict:
    import torch
    import torch.distributed as dist

    import compat.parallel_state as ps
    from tests.support.worlds import split_stand_in

    split_stand_in.install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2)
    groups = {key: list(value) for key, value in ps.get_state().ranks.items()}
    sums = {}
    for name, group in (("tp", ps.get_tensor_model_parallel_group()), ("dp", ps.get_data_parallel_group())):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        sums[name] = value.item()
    ps.destroy_model_parallel()
    return {"groups": groups, "sums": sums, "left": len(dist.distributed_c10d._world.pg_map)}


def test_groups_work_and_equal_the_member_path(tmp_path):
    from compat._release import RELEASE
    from parallel_state_ng.layout.megatron_layout import MegatronLayout

    # The member path's groups are the layout's (the per-release differential checks them against MCore's).
    layout = MegatronLayout(
        world_size=WORLD, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, release=RELEASE.series
    )
    results = run_world(WORLD, str(tmp_path), init_and_check, 2, timeout=120, env=ENV)
    assert sorted(results) == list(range(WORLD)), results
    for rank, result in results.items():
        assert not isinstance(result, tuple), result
        tp = result["groups"]["tp"]
        assert rank in tp and result["sums"]["tp"] == sum(tp)
        assert result["sums"]["dp"] == sum(result["groups"]["dp"])
        assert result["left"] == 1  # only the default group
        assert result["groups"] == {kind: layout.group(kind, rank) for kind in result["groups"]}


def disagree(rank: int, directory: str, what: str) -> dict:
    import compat.parallel_state as ps
    from tests.support.worlds import split_stand_in

    split_stand_in.install()
    if what == "path" and rank == 1:
        os.environ["PSNG_CREATION_PATH"] = "member"
    tp = 1 if what == "size" and rank == 2 else 2
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2)
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


@pytest.mark.parametrize("what", ["size", "path"])
def test_a_rank_that_disagrees_makes_every_rank_raise(tmp_path, what):
    results = run_world(WORLD, str(tmp_path), disagree, what, timeout=90, env=ENV)
    assert sorted(results) == list(range(WORLD)), results
    for result in results.values():
        assert result["error"] == "ParallelConfigMismatchError", result
    if what == "path":
        assert "creation path" in results[0]["message"]


def die_between_splits(rank: int, directory: str, k: int) -> dict:
    import torch.distributed as dist

    import compat.parallel_state as ps
    from parallel_state_ng.groups.liveness import RankFailureError
    from tests.support.worlds import split_stand_in

    split_stand_in.install()
    if rank == 3:
        calls = [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                os._exit(1)
            return split_stand_in.gloo_split(*args, **kwargs)

        dist.split_group = dying
    dist.barrier()
    start = time.monotonic()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        outcome = {"error": None}
    except RankFailureError as err:
        outcome = {"error": "RankFailureError", "dead": err.dead, "message": str(err)}
    except Exception as err:
        outcome = {"error": type(err).__name__, "message": str(err)}
    outcome["seconds"] = time.monotonic() - start
    outcome["left"] = len(dist.distributed_c10d._world.pg_map)
    outcome["initialized"] = ps.model_parallel_is_initialized()
    return outcome


def test_a_rank_dying_between_splits_is_named_within_the_bound(tmp_path):
    results = run_world(WORLD, str(tmp_path), die_between_splits, 3, expect=WORLD - 1, timeout=90, env=ENV)
    assert sorted(results) == [0, 1, 2], results
    for result in results.values():
        assert result["error"] == "RankFailureError", result
        assert result["dead"] == [3], result
        assert result["seconds"] < 4 * float(BOUND), result
        assert result["left"] == 1 and result["initialized"] is False, result


def die_nonblocking(rank: int, directory: str, k: int) -> dict:
    import compat.parallel_state as ps
    from parallel_state_ng.groups.nonblocking import ENV_NONBLOCKING_TIMEOUT, NonblockingBoundError

    set_timeout = os.environ.pop(ENV_NONBLOCKING_TIMEOUT)
    try:  # unset: torch would wait 30 minutes in a split; refused on every rank before any split
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        refused = None
    except NonblockingBoundError as err:
        refused = str(err)
    os.environ[ENV_NONBLOCKING_TIMEOUT] = set_timeout
    return {"refused": refused, **die_between_splits(rank, directory, k)}


def test_nonblocking_nccl_is_refused_unbounded_and_a_death_is_named_within_the_bound(tmp_path):
    # the stand-in waits as torch waits for a nonblocking split: TORCH_NCCL_NONBLOCKING_TIMEOUT
    # whole seconds, not the split's timeout; 1 s is the longest a 6 s bound holds
    env = {
        **ENV,
        "PSNG_FAILURE_TIMEOUT": "6",
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": "1",
    }
    results = run_world(WORLD, str(tmp_path), die_nonblocking, 3, expect=WORLD - 1, timeout=90, env=env)
    assert sorted(results) == [0, 1, 2], results
    for result in results.values():
        assert "TORCH_NCCL_NONBLOCKING_TIMEOUT is unset" in (result["refused"] or ""), result
        assert result["error"] == "RankFailureError" and result["dead"] == [3], result
        assert result["seconds"] < 6.0, result
        assert result["left"] == 1 and result["initialized"] is False, result
