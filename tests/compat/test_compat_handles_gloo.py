"""Group handles over the compat state's groups, on a real gloo world of 4."""

import torch
import torch.distributed as dist


def _handles_agree_with_getters():
    import compat.parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    try:
        state = ps.get_state()
        pp = state.handle("pp")
        tp = state.handle("tp")
        dp = state.handle("dp")
        assert state.handle("pp") is pp  # cached
        facts = {
            "pp_ranks": pp.ranks == ps._PIPELINE_GLOBAL_RANKS,
            "pp_first": pp.first_rank == ps.get_pipeline_model_parallel_first_rank(),
            "pp_last": pp.last_rank == ps.get_pipeline_model_parallel_last_rank(),
            "pp_next": pp.next_rank == ps.get_pipeline_model_parallel_next_rank(),
            "pp_prev": pp.prev_rank == ps.get_pipeline_model_parallel_prev_rank(),
            "pp_is_first": pp.is_first == ps.is_pipeline_first_stage(),
            "pp_is_last": pp.is_last == ps.is_pipeline_last_stage(),
            "tp_rank": tp.rank_in_group == ps.get_tensor_model_parallel_rank(),
            "tp_group": tp.group is ps.get_tensor_model_parallel_group(),
            # the gloo twin serves as the CPU group: no new group is made for it
            "dp_cpu_is_gloo_twin": dp.has_cpu_group and dp.cpu_group is ps.get_data_parallel_group_gloo(),
        }
        total = tp.all_reduce(torch.tensor([float(dist.get_rank())])).item()
        dp.barrier()
        obj = dp.broadcast_object({"from": dist.get_rank()} if dp.is_first else None)
        live_before_destroy = len(dist.distributed_c10d._world.pg_map)
    finally:
        ps.destroy_model_parallel()
    return (
        facts,
        total,
        sum(tp.ranks),
        obj["from"],
        dp.first_rank,
        live_before_destroy,
        len(dist.distributed_c10d._world.pg_map),
    )


def _missing_kind_raises():
    import compat.parallel_state as ps

    ps.initialize_model_parallel(pipeline_model_parallel_size=4, create_gloo_process_groups=False)
    try:
        try:
            ps.get_state().handle("embd")
            in_embedding = True
        except KeyError as exc:
            in_embedding = False
            assert "embd" in str(exc)
        return in_embedding == ps.is_rank_in_embedding_group()
    finally:
        ps.destroy_model_parallel()


def test_compat_state_handles(gloo_world):
    world = gloo_world(4)
    for facts, total, expected, src, first, live_before, live_after in world.run(_handles_agree_with_getters):
        assert all(facts.values()), facts
        assert total == expected
        assert src == first
        assert live_after == 1 < live_before  # only the default group survives destroy


def test_handle_for_a_group_the_rank_lacks(gloo_world):
    assert all(gloo_world(4).run(_missing_kind_raises))
