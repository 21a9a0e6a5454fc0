"""Abort and destroy with dead or stopped peers (real gloo worlds; a rank exits or stops itself).

``abort_model_parallel`` must return within seconds whatever the peers do, leave torch's
registries as before the groups existed and reset every global; ``destroy_model_parallel``,
grids' and ``MegatronGroups``' ``destroy()`` must then succeed at once, also after torch's own
teardown of every group (what nvidia-resiliency-ext's ``AbortTorchDistributed`` does).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.worlds.failure import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD = 4
LOST = 3


def _build_everything():
    """The compat grid (tp2 pp2, gloo twins), a HyperCommGrid and MegatronGroups on every rank."""
    import compat.parallel_state as ps
    from parallel_state_ng import HyperCommGrid, build_megatron_groups

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    grid.create_pg("tp")
    grid.create_pg("dp")
    grid.group("tp", cpu=True)  # a handle's gloo companion
    groups = build_megatron_groups(tensor_model_parallel_size=2, check_agreement_across_ranks=False)
    return ps, grid, groups


def _lose_rank(rank: int, how: str) -> None:
    import torch.distributed as dist

    dist.barrier()  # every group exists everywhere before the loss
    if rank == LOST:
        if how == "dead":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)  # the loss has happened


def abort_after_loss(rank: int, directory: str, how: str, world: bool) -> dict:
    import torch.distributed as dist

    tags_before = sorted(dist.distributed_c10d._world.tags_to_pg)
    ps, grid, groups = _build_everything()
    before = len(dist.distributed_c10d._world.pg_map)
    _lose_rank(rank, how)
    start = time.monotonic()
    result = ps.abort_model_parallel(world=world)
    abort_s = time.monotonic() - start
    start = time.monotonic()
    ps.destroy_model_parallel()
    grid.destroy()
    destroyed = groups.destroy()
    destroy_s = time.monotonic() - start
    return {
        "before": before,
        "aborted": result.aborted,
        "abort_s": abort_s,
        "destroy_s": destroy_s,
        "destroyed_after_abort": destroyed,
        "left": len(dist.distributed_c10d._world.pg_map),
        "tags": sorted(dist.distributed_c10d._world.tags_to_pg),
        "tags_before": tags_before,
        "initialized": ps.model_parallel_is_initialized(),
        "world_initialized": dist.is_initialized(),
        "tp_group": ps._TENSOR_MODEL_PARALLEL_GROUP,
    }


@pytest.mark.parametrize(("how", "world"), [("dead", False), ("stopped", True)])
def test_abort_returns_at_once_and_leaves_nothing(tmp_path, how, world):
    results = run_world(WORLD, str(tmp_path), abort_after_loss, how, world, expect=WORLD - 1, timeout=60)
    assert sorted(results) == [0, 1, 2], results
    for rank, r in results.items():
        assert isinstance(r, dict), (rank, r)
        assert r["aborted"] > 10  # compat's ~20 groups, the grid's, the collection's
        assert r["abort_s"] < 3.0, r
        assert r["destroy_s"] < 3.0, r
        assert r["destroyed_after_abort"] == 0
        assert r["initialized"] is False and r["tp_group"] is None
        if world:
            assert r["tags"] == [], r
            assert r["left"] == 0 and r["world_initialized"] is False
        else:
            assert r["left"] == 1 and r["world_initialized"] is True  # only the default group
            assert r["tags"] == r["tags_before"], r


def destroy_after_torch_teardown(rank: int, directory: str, how: str) -> dict:
    """What an in-process restart does: torch's teardown of every group, then Megatron's destroy."""
    import torch.distributed as dist

    ps, grid, groups = _build_everything()
    _lose_rank(rank, how)
    start = time.monotonic()
    try:  # nvidia-resiliency-ext's AbortTorchDistributed when installed, else its two steps
        from nvidia_resiliency_ext.inprocess.abort import AbortTorchDistributed

        AbortTorchDistributed()(None)
        used = "AbortTorchDistributed"
    except ImportError:
        for group in list(dist.distributed_c10d._world.pg_names):  # NCCL backends only: none on CPU
            try:
                group._get_backend(__import__("torch").device("cuda")).abort()
            except (RuntimeError, AttributeError):  # AttributeError: torch 2.6's gloo backend has no abort()
                pass
        dist.destroy_process_group()
        used = "torch teardown"
    teardown_s = time.monotonic() - start
    start = time.monotonic()
    ps.destroy_model_parallel()
    grid.destroy()
    groups.destroy()
    destroy_s = time.monotonic() - start
    from parallel_state_ng.groups import creation

    return {
        "used": used,
        "teardown_s": teardown_s,
        "destroy_s": destroy_s,
        "initialized": ps.model_parallel_is_initialized(),
        "live": len(creation.live_groups()),
        "left": len(dist.distributed_c10d._world.pg_map),
    }


@pytest.mark.parametrize("how", ["dead", "stopped"])
def test_destroy_after_someone_else_tore_everything_down(tmp_path, how):
    results = run_world(WORLD, str(tmp_path), destroy_after_torch_teardown, how, expect=WORLD - 1, timeout=60)
    assert sorted(results) == [0, 1, 2], results
    for rank, r in results.items():
        assert isinstance(r, dict), (rank, r)
        assert r["teardown_s"] < 3.0 and r["destroy_s"] < 3.0, r
        assert r["initialized"] is False and r["live"] == 0 and r["left"] == 0, r


def destroy_soon_after_loss(rank: int, directory: str) -> dict:
    """A plain destroy after a member died before marking its groups ready: not waited for once known dead."""
    import torch.distributed as dist

    from parallel_state_ng.groups import creation

    if rank == LOST:  # as if it died right after connecting, before its readiness marks
        creation._mark_ready = lambda *args: None
    ps, grid, groups = _build_everything()
    _lose_rank(rank, "dead")
    creation.mark_dead([LOST])
    start = time.monotonic()
    ps.destroy_model_parallel()
    grid.destroy()
    groups.destroy()
    return {"destroy_s": time.monotonic() - start, "left": len(dist.distributed_c10d._world.pg_map)}


def test_destroy_does_not_wait_for_a_dead_member(tmp_path):
    results = run_world(
        WORLD, str(tmp_path), destroy_soon_after_loss, expect=WORLD - 1, timeout=60,
        env={"PSNG_DESTROY_SETTLE_TIMEOUT": "600"},
    )  # fmt: skip
    assert sorted(results) == [0, 1, 2], results
    for r in results.values():
        assert isinstance(r, dict), r
        assert r["destroy_s"] < 3.0 and r["left"] == 1, r
