"""Per-release facts for Megatron's pg_collection path (groups from a ``ProcessGroupCollection``).

Read from each release's ``parallel_state.py``, ``pipeline_parallel/schedules.py`` and
``p2p_communication.py`` (0.15.3 … 0.19.2, compared with the wheels by
``tests/releases/test_new_code_path_releases.py``): the functions that work inside a no-globals
scope, the initialization probes, the schedules and who takes ``p2p_communicator=``. See
docs/compat.md ("Scoping", "The rest of the pg_collection set-up").
"""

from __future__ import annotations

__all__ = [
    "GRID_FREE_FUNCTIONS",
    "INITIALIZATION_PROBES",
    "FORWARD_BACKWARD_FUNC_PARAMS",
    "SCHEDULE_MODULE",
    "SCHEDULE_FUNCTIONS",
    "P2P_COMMUNICATOR_TAKERS",
    "P2P_COMMUNICATOR",
]

#: Functions that touch no grid. Not among them: the symmetric memory buffer (built over the
#: tensor-parallel group of the grid that created it) and ``create_group`` /
#: ``create_hierarchical_groups`` (they add the group to the grid's destroy list).
GRID_FREE_FUNCTIONS: frozenset[str] = frozenset(
    {
        "get_global_memory_buffer",
        "destroy_global_memory_buffer",
        "get_nccl_options",
        "overwrite_nccl_comm_cfgs",
        "generate_masked_orthogonal_rank_groups",
        "default_embedding_ranks",
        "default_position_embedding_ranks",
        "get_moe_layer_wise_logging_tracker",
    }
)

#: Initialization probes -> their answer inside a no-globals scope ("not initialized").
#: Megatron's pg_collection code asks them to decide whether to fall back to the globals
#: (0.19 ``utils.get_tensor_model_parallel_group_if_none`` passes its ``tp_group`` through
#: when ``is_initialized()`` is False), so they must not raise there.
INITIALIZATION_PROBES: dict[str, bool] = {
    "model_parallel_is_initialized": False,
    "is_initialized": False,
    "is_unitialized": True,
}

_SERIES = ("0.15", "0.16", "0.17", "0.18", "0.19")

#: ``megatron.core.pipeline_parallel.schedules.get_forward_backward_func``'s parameters.
FORWARD_BACKWARD_FUNC_PARAMS: dict[str, tuple[str, ...]] = {
    "0.15": (),
    "0.16": ("pp_size", "vp_size"),
    "0.17": ("pp_size", "vp_size"),
    "0.18": ("pp_size", "vp_size"),
    "0.19": ("pp_size", "vp_size", "schedule_pg_collection"),
}

SCHEDULE_MODULE = "megatron.core.pipeline_parallel.schedules"
#: ``(no pipelining, 1F1B, interleaved 1F1B)``: what ``get_forward_backward_func`` picks for
#: pp = 1, pp > 1 without and pp > 1 with a virtual pipeline size.
SCHEDULE_FUNCTIONS: tuple[str, str, str] = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
_PIPELINED = SCHEDULE_FUNCTIONS[1:]

#: Schedule functions taking ``p2p_communicator=`` (every one takes ``pg_collection=``, 0.15+).
P2P_COMMUNICATOR_TAKERS: dict[str, tuple[str, ...]] = {
    "0.15": _PIPELINED,
    **{series: SCHEDULE_FUNCTIONS for series in _SERIES[1:]},
}

#: ``(module, class, constructor parameters)`` of the pipeline's point-to-point communicator.
P2P_COMMUNICATOR: dict[str, tuple[str, str, tuple[str, ...]]] = dict.fromkeys(
    _SERIES, ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator", ("pp_group", "config"))
)
