"""What replaced the parts of ``megatron.core.parallel_state`` that a later release removed.

:data:`REPLACEMENTS` maps a removed function, parameter (``"function.parameter"``) or global to
what to use instead and the first series that has it; :func:`replacement` answers for one
release. Re-exported by :mod:`parallel_state_ng.releases.parallel_state` with the rest of the
API surface.
"""

from __future__ import annotations

from parallel_state_ng.releases import Release, known_release

__all__ = ["REPLACEMENTS", "replacement"]

#: What to use instead of a function, parameter (``"function.parameter"``) or global that a later
#: release removed: key -> (replacement, first series that has the replacement). Keys absent
#: here have no equivalent.
REPLACEMENTS: dict[str, tuple[str, str]] = {
    "is_unitialized": ("not is_initialized()", "0.12"),
    "get_data_modulo_expert_parallel_group": ("get_expert_data_parallel_group", "0.12"),
    "get_inter_partial_data_parallel_group": ("get_inter_distributed_optimizer_instance_group", "0.13"),
    "_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("get_inter_distributed_optimizer_instance_group()", "0.13"),
    "create_hierarchical_parallel_groups": ("create_hierarchical_groups (no group_size parameter)", "0.13"),
    "get_moe_layer_wise_logging_tracker": (
        "megatron.core.transformer.moe.moe_utils.get_moe_layer_wise_logging_tracker",
        "0.13",
    ),
    "_MOE_LAYER_WISE_LOGGING_TRACKER": (
        "megatron.core.transformer.moe.moe_utils.get_moe_layer_wise_logging_tracker()",
        "0.13",
    ),
    "get_global_symmetric_memory_buffer": ("megatron.core.inference.symmetric_memory.SymmetricMemoryManager", "0.17"),
    "destroy_global_symmetric_memory_buffer": (
        "megatron.core.inference.symmetric_memory.SymmetricMemoryManager.destroy()",
        "0.17",
    ),
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": ("megatron.core.inference.symmetric_memory.SymmetricMemoryManager", "0.17"),
    "initialize_model_parallel.create_all_gather_group": (
        "create_all_gather_groups() after initialize_model_parallel",
        "0.18",
    ),
    "get_data_parallel_group.independent_all_gather": (
        "the data-parallel all-gather group returned by create_all_gather_groups()",
        "0.18",
    ),
    "has_separate_all_gather_group": ("the groups create_all_gather_groups() returns", "0.18"),
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": ("the first group returned by create_all_gather_groups()", "0.18"),
}


def replacement(key: str, release: str | Release) -> str | None:
    """What to use in ``release`` instead of ``key`` (a function, ``"function.parameter"`` or a
    global that ``release`` lacks), or ``None``: no equivalent there.
    """
    found = REPLACEMENTS.get(key)
    if found is None or not known_release(release).at_least(found[1]):
        return None
    return found[0]
