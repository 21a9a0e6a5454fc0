"""``initialize_model_parallel``'s parameters in every supported release (data).

Read from each release's ``parallel_state.py``: 0.14's list, and each other release as its
changes to a neighbour (parameters inserted, dropped or appended, with their defaults).
:mod:`.surface` and :mod:`.legacy` read these into their tables.
"""

from __future__ import annotations

from parallel_state_ng.releases.parallel_state.signatures import Param, drop_param, insert_params, params

__all__ = ["INIT_012", "INIT_013", "INIT_014", "INIT_016", "INIT_017", "INIT_018", "INIT_019"]

#: 0.14's parameters, the base the other releases are stated against.
INIT_014 = params(
    ("tensor_model_parallel_size", 1),
    ("pipeline_model_parallel_size", 1),
    ("virtual_pipeline_model_parallel_size", None),
    ("pipeline_model_parallel_comm_backend", None),
    ("use_sharp", False),
    ("context_parallel_size", 1),
    ("hierarchical_context_parallel_sizes", None),
    ("expert_model_parallel_size", 1),
    ("num_distributed_optimizer_instances", 1),
    ("expert_tensor_parallel_size", None),
    ("nccl_communicator_config_path", None),
    ("distributed_timeout_minutes", 30),
    ("order", "tp-cp-ep-dp-pp"),
    ("get_embedding_ranks", None),
    ("get_position_embedding_ranks", None),
    ("create_gloo_process_groups", True),
    ("high_priority_stream_groups", None),
    ("sharp_enabled_group", None),
)


# 0.16: hybrid_context_parallel after hierarchical_context_parallel_sizes; create_all_gather_group last.
INIT_016 = insert_params(INIT_014, "hierarchical_context_parallel_sizes", ("hybrid_context_parallel", False)) + (
    ("create_all_gather_group", False),
)
# 0.17: rank_offset, local_world_size appended.
INIT_017 = INIT_016 + (("rank_offset", 0), ("local_world_size", None))
# 0.18: create_all_gather_group removed (create_all_gather_groups() after init instead).
INIT_018 = drop_param(INIT_017, "create_all_gather_group")
# 0.19: gtp_remat_size, expert_gtp_remat_size after expert_model_parallel_size.
INIT_019 = insert_params(INIT_018, "expert_model_parallel_size", ("gtp_remat_size", 1), ("expert_gtp_remat_size", 1))

# 0.12: no high_priority_stream_groups / sharp_enabled_group yet; the encoder/decoder era's
# pipeline_model_parallel_split_rank after virtual_pipeline_model_parallel_size and the encoder
# sizes after order.
INIT_012: tuple[Param, ...] = insert_params(
    insert_params(
        drop_param(drop_param(INIT_014, "high_priority_stream_groups"), "sharp_enabled_group"),
        "virtual_pipeline_model_parallel_size",
        ("pipeline_model_parallel_split_rank", None),
    ),
    "order",
    ("encoder_tensor_model_parallel_size", 0),
    ("encoder_pipeline_model_parallel_size", 0),
)
# 0.13: high_priority_stream_groups appended.
INIT_013 = INIT_012 + (("high_priority_stream_groups", None),)
