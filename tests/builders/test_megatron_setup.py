"""``megatron_schedule`` / ``ensure_global_memory_buffer`` with the installed megatron-core (fake backend).

Next to a legacy grid in compat's globals (pp 4) a new module (pp 2) gets its schedule, pipeline
sizes and communicator from its own collection inside its no-globals scope; bad arguments raise
errors naming them; 0.15's rule (no sizes taken by ``get_forward_backward_func``) picks the same
functions. Per-release agreement with MCore: ``tests/releases/test_new_code_path_releases.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

import compat  # noqa: E402
import compat.parallel_state as ps  # noqa: E402
from parallel_state_ng import build_megatron_groups, ensure_global_memory_buffer, megatron_schedule  # noqa: E402
from parallel_state_ng.builders.collection import NoCollectionError  # noqa: E402
from parallel_state_ng.releases.new_code_path import P2P_COMMUNICATOR_TAKERS  # noqa: E402
from tests.support.served import has_collection, served, skip_unless  # noqa: E402


def _config(pp: int, vp: int | None = None):
    from megatron.core.model_parallel_config import ModelParallelConfig

    extra = {"pipeline_dtype": torch.float32} if pp > 1 else {}
    return ModelParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp, **extra)


@pytest.fixture
def legacy_and_new(fake_world):
    """Rank 6 of 8, compat installed: legacy tp 2 pp 4 in the globals, a new module pp 2."""
    skip_unless(has_collection(), "has no pg_collection schedule path (it came in 0.15)")
    assert not compat.is_installed(), "a previous test left compat installed"
    fake_world(6, 8)
    compat.install()
    ps.initialize_model_parallel(pipeline_model_parallel_size=4, create_gloo_process_groups=False)
    groups = build_megatron_groups(pipeline_model_parallel_size=2)
    try:
        yield groups
    finally:
        groups.destroy()
        ps.destroy_model_parallel()
        compat.uninstall()


@pytest.mark.parametrize("release", [None, "0.15"])
@pytest.mark.parametrize("vp", [None, 2])
def test_schedule_from_the_collection_inside_the_scope(legacy_and_new, vp, release):
    from megatron.core.pipeline_parallel import schedules

    pgc = legacy_and_new.collection()
    with legacy_and_new.scope():
        sched = megatron_schedule(pgc, _config(2, vp), release=release)
        assert ensure_global_memory_buffer() is ps.get_global_memory_buffer()  # the one init created
    want = "forward_backward_pipelining_with_interleaving" if vp else "forward_backward_pipelining_without_interleaving"
    assert sched.forward_backward_func is getattr(schedules, want)
    assert (sched.pp_size, sched.vp_size) == (2, vp)
    assert sched.kwargs["pg_collection"] is pgc
    comm = sched.kwargs["p2p_communicator"]
    assert comm.pp_group is pgc.pp and dist.get_process_group_ranks(pgc.pp) == [2, 6]
    assert (comm.next_rank, comm.prev_rank) == (2, 2)
    # the globals' pipeline (pp 4) would have picked other neighbours
    assert ps.get_pipeline_model_parallel_world_size() == 4


def test_no_pipelining_and_kwargs_are_not_repeated(fake_world):
    skip_unless(has_collection(), "has no pg_collection schedule path (it came in 0.15)")
    from megatron.core.pipeline_parallel import schedules

    fake_world(1, 2)
    with build_megatron_groups(tensor_model_parallel_size=2) as groups:
        sched = megatron_schedule(groups, _config(1))
        assert sched.forward_backward_func is schedules.forward_backward_no_pipelining
        takes = "forward_backward_no_pipelining" in P2P_COMMUNICATOR_TAKERS[served().series]
        assert ("p2p_communicator" in sched.kwargs) == takes  # 0.16+ takes it there too (unused by MCore)
        assert "p2p_communicator" not in megatron_schedule(groups, _config(1), release="0.15").kwargs
        with pytest.raises(TypeError, match="pg_collection"):
            sched(pg_collection=None)


def test_bad_arguments_name_themselves(fake_world):
    skip_unless(has_collection(), "has no pg_collection schedule path (it came in 0.15)")
    fake_world(0, 4)
    with build_megatron_groups(pipeline_model_parallel_size=2) as groups:
        with pytest.raises(ValueError, match=r"pipeline_model_parallel_size \(4\).*pipeline size \(2"):
            megatron_schedule(groups, _config(4))
        with pytest.raises(TypeError, match="config must be Megatron's ModelParallelConfig"):
            megatron_schedule(groups, object())
        with pytest.raises(TypeError, match="collection must be a ProcessGroupCollection with a pp group"):
            megatron_schedule(object(), _config(2))
        with pytest.raises(NoCollectionError, match="0.14 has no pg_collection schedule path"):
            megatron_schedule(groups, _config(2), release="0.14")
    fake_world(0, 2)
    with build_megatron_groups(tensor_model_parallel_size=2) as groups:
        config = _config(1)
        config.virtual_pipeline_model_parallel_size = 2
        with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size is 2 .*\(pp size 1\)"):
            megatron_schedule(groups, config)


def test_memory_buffer_without_compat_is_megatrons_own(fake_world):
    from megatron.core import parallel_state as mps

    assert not compat.is_installed()
    fake_world(0, 2)
    assert mps._GLOBAL_MEMORY_BUFFER is None
    try:
        buffer = ensure_global_memory_buffer()
        assert buffer is mps.get_global_memory_buffer() and ensure_global_memory_buffer() is buffer
    finally:
        mps.destroy_global_memory_buffer()
