"""Simulated worlds serve Megatron's defaults: a gloo group asked for on one is a fake-backend stand-in.

torch's fake backend cannot create a gloo group (2.13: an internal assert; 2.14: a crash of the
process); parallel_state_ng.testing.simulated wraps torch's group-creation helper so that on a
fake world a gloo group is a fake group over the same ranks. Checked here: compat's and MCore's
``initialize_model_parallel`` with their default gloo twins, torch's own ``new_group``, and a
real (one-process) gloo world that keeps torch's gloo groups.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from parallel_state_ng.testing.simulated import install_gloo_stand_in, simulated_rank

TWINS = {  # gloo getter -> the getter of the group it twins (Megatron's names)
    "get_data_parallel_group_gloo": "get_data_parallel_group",
    "get_expert_data_parallel_group_gloo": "get_expert_data_parallel_group",
}


def _twins(ps) -> dict[str, tuple[list[int], list[int], str]]:
    seen = {}
    for gloo, dense in TWINS.items():
        twin, group = getattr(ps, gloo)(), getattr(ps, dense)()
        seen[gloo] = (dist.get_process_group_ranks(twin), dist.get_process_group_ranks(group), dist.get_backend(twin))
    twin = ps.get_data_parallel_group_gloo(with_context_parallel=True)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    seen["dp_cp"] = (dist.get_process_group_ranks(twin), dist.get_process_group_ranks(group), dist.get_backend(twin))
    return seen


@pytest.mark.parametrize("impl", ["compat", "mcore"])
def test_megatron_defaults_on_a_simulated_rank(impl):
    if impl == "compat":
        import compat.parallel_state as ps
    else:
        ps = pytest.importorskip("megatron.core.parallel_state")
    with simulated_rank(5, 8):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        try:
            seen = _twins(ps)
        finally:
            ps.destroy_model_parallel()
    # rank 5 of tp2 pp2 dp2 (tp-cp-ep-dp-pp): dp over [5, 7]; each twin has its group's ranks
    assert seen["get_data_parallel_group_gloo"][0] == [5, 7]
    for name, (twin, group, backend) in seen.items():
        assert twin == group and backend == "fake", name


def test_compat_matches_mcore_on_the_twins():
    mcore = pytest.importorskip("megatron.core.parallel_state")
    import compat.parallel_state as ps

    found = {}
    for name, module in (("mcore", mcore), ("compat", ps)):
        with simulated_rank(3, 16):
            module.initialize_model_parallel(
                tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2
            )
            try:
                found[name] = _twins(module)
            finally:
                module.destroy_model_parallel()
    assert found["compat"] == found["mcore"]


@pytest.mark.parametrize("backend", ["gloo", "GLOO", "cpu:gloo"])
def test_torchs_own_new_group(backend):
    with simulated_rank(6, 8):
        group = dist.new_group([2, 6, 7], backend=backend)
        assert dist.get_process_group_ranks(group) == [2, 6, 7]
        assert (group.rank(), group.size(), dist.get_rank(group)) == (1, 3, 1)
        assert "fake" in str(dist.get_backend(group))
        outside = dist.new_group([0, 1], backend=backend)
        assert outside == dist.GroupMember.NON_GROUP_MEMBER
        member_only = dist.new_group([5, 6], backend=backend, use_local_synchronization=True)
        assert dist.get_process_group_ranks(member_only) == [5, 6]
        dist.barrier(group)  # a collective on the stand-in does nothing, as on the fake world


def test_a_real_gloo_world_keeps_torchs_gloo(tmp_path):
    assert install_gloo_stand_in()
    assert install_gloo_stand_in()  # idempotent
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        group = dist.new_group([0], backend="gloo")
        assert dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()
