"""Facts about ``megatron.core.parallel_state`` of the legacy releases 0.12 and 0.13 (data only).

Read from 0.12.3's and 0.13.1's ``parallel_state.py``, stated as differences from 0.14 (what
0.14 has is in 0.12/0.13 too unless stated here); :mod:`.surface` merges these tables into
its own at import; query them through :mod:`parallel_state_ng.releases.parallel_state`. See
docs/releases.md ("The encoder/decoder era").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parallel_state_ng.releases.parallel_state.initialize import INIT_012, INIT_013

__all__ = [
    "FIRST_IN_013",
    "INIT_012",
    "INIT_013",
    "LEGACY_VARIANTS",
    "LEGACY_ONLY",
    "LEGACY_GLOBALS",
    "GLOBAL_VALUE_EXCEPTIONS",
]

#: ``(first series, last series, *parameters)``.
if TYPE_CHECKING:
    from typing_extensions import Unpack

    Spec = tuple[str, str, Unpack[tuple[str | tuple[str, Any], ...]]]
else:  # (first series, last series, *parameters); a parameter: a bare name (required) or (name, default)
    Spec = tuple[str | tuple[str, Any], ...]

#: Names 0.14 has whose first release is 0.13 (0.12 lacks them).
FIRST_IN_013 = frozenset(
    {
        "create_hierarchical_groups",
        "overwrite_nccl_comm_cfgs",
        "get_intra_distributed_optimizer_instance_group",
        "get_inter_distributed_optimizer_instance_group",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    }
)

_ONLY_012: list[Spec] = [("0.12", "0.12")]  # 0.12 without parameters
_FIRST_STAGE_012: list[Spec] = [("0.12", "0.12", ("ignore_virtual", False))]  # no vp_stage, other default

#: Functions 0.14 has whose 0.12/0.13 signatures differ: name -> the signatures within 0.12-0.13
#: (0.14's covers the rest).
LEGACY_VARIANTS: dict[str, list[Spec]] = {
    "default_embedding_ranks": [("0.12", "0.13", "pp_ranks", ("split_rank", None))],
    "default_position_embedding_ranks": [("0.12", "0.13", "pp_ranks", ("split_rank", None))],
    "initialize_model_parallel": [("0.12", "0.12", *INIT_012), ("0.13", "0.13", *INIT_013)],
    **{
        name: _ONLY_012
        for name in (
            "get_model_parallel_group",
            "get_pipeline_model_parallel_group",
            "get_embedding_group",
            "get_position_embedding_group",
            "get_tensor_and_context_parallel_group",
            "get_expert_tensor_model_pipeline_parallel_group",
            "get_expert_data_parallel_group",
            "get_data_modulo_expert_parallel_group",
            "get_expert_data_parallel_group_gloo",
            "get_expert_data_parallel_rank",
            "get_expert_data_parallel_world_size",
        )
    },
    "is_pipeline_first_stage": _FIRST_STAGE_012,
    "is_pipeline_last_stage": _FIRST_STAGE_012,
    "is_rank_in_embedding_group": _FIRST_STAGE_012,
}

_RANK = ("rank", None)
#: Functions only 0.12/0.13 have: name -> (the function it follows in MCore's module, signatures).
LEGACY_ONLY: dict[str, tuple[str, list[Spec]]] = {
    "create_hierarchical_parallel_groups": (
        "generate_masked_orthogonal_rank_groups",
        [("0.12", "0.12", "rank", "ranks", "group_size", "hierarchical_group_sizes", "pg_options")],
    ),
    "get_inter_partial_data_parallel_group": ("get_data_parallel_group_gloo", _ONLY_012),
    "set_pipeline_model_parallel_split_rank": ("set_pipeline_model_parallel_rank", [("0.12", "0.13", "rank")]),
    "get_pipeline_model_parallel_split_rank": ("get_pipeline_model_parallel_rank", [("0.12", "0.13")]),
    "is_pipeline_stage_before_split": ("is_rank_in_position_embedding_group", [("0.12", "0.13", _RANK)]),
    "is_pipeline_stage_after_split": ("is_pipeline_stage_before_split", [("0.12", "0.13", _RANK)]),
    "is_inside_encoder": ("is_pipeline_stage_after_split", [("0.12", "0.13", _RANK)]),
    "is_inside_decoder": ("is_inside_encoder", [("0.12", "0.13", _RANK)]),
    "get_pipeline_model_parallel_decoder_start": ("is_inside_decoder", [("0.12", "0.13")]),
    "is_pipeline_stage_at_split": ("get_pipeline_model_parallel_decoder_start", [("0.12", "0.13")]),
    "get_moe_layer_wise_logging_tracker": ("get_all_ranks", _ONLY_012),
}

#: Globals only 0.12/0.13 have: name -> (first series, last series, value at import).
LEGACY_GLOBALS: dict[str, tuple[str, str, type | None]] = {
    "_PIPELINE_MODEL_PARALLEL_SPLIT_RANK": ("0.12", "0.13", None),
    "_PIPELINE_MODEL_PARALLEL_DECODER_START": ("0.12", "0.13", None),
    "_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("0.12", "0.12", None),
    "_MOE_LAYER_WISE_LOGGING_TRACKER": ("0.12", "0.12", dict),
}

#: Globals whose import-time value differs in some series from the one in ``GLOBALS``:
#: name -> {series: value}.
GLOBAL_VALUE_EXCEPTIONS: dict[str, dict[str, type | None]] = {
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": {"0.12": list},
}
