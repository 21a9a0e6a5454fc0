"""The API surface of ``megatron.core.parallel_state`` per release, as tables (data).

Read from each release's ``parallel_state.py`` (0.14.0 … 0.19.2), written in the vocabulary of
:mod:`.signatures`; the 0.12/0.13 entries (:mod:`.legacy`) are merged in at import.
:data:`FUNCTIONS`: each public function's signature variants, in MCore's module order;
:data:`GLOBALS`: each module global's releases and import-time value; :data:`RANK_GENERATOR`:
``RankGenerator``'s methods. Query them through :mod:`.queries`.
"""

from __future__ import annotations

from typing import Any

from parallel_state_ng.releases import KNOWN_SERIES, SUPPORTED_SERIES
from parallel_state_ng.releases.parallel_state import legacy as _legacy
from parallel_state_ng.releases.parallel_state.initialize import INIT_014, INIT_016, INIT_017, INIT_018, INIT_019
from parallel_state_ng.releases.parallel_state.signatures import Variant
from parallel_state_ng.releases.parallel_state.signatures import series_after as _next
from parallel_state_ng.releases.parallel_state.signatures import variant as _v

__all__ = ["FUNCTIONS", "GLOBALS", "RANK_GENERATOR"]


# The tables below are written for the modern releases (0.14 on); the legacy 0.12/0.13 entries
# are merged in at the end of the module.
_MODERN_FIRST = "0.14"
_ALL = (_MODERN_FIRST, SUPPORTED_SERIES[-1])


def _always(*spec: str | tuple[str, Any]) -> list[Variant]:
    return [_v(*_ALL, *spec)]


_CHECK = ("check_initialized", True)

#: name -> signature variants, in the order the functions appear in MCore's module. A function
#: exists in a release iff a variant covers it; every parameter is positional-or-keyword.
FUNCTIONS: dict[str, list[Variant]] = {
    "get_nccl_options": _always("pg_name", "nccl_comm_cfgs"),
    "update_pg_timeout": [_v("0.15", "0.19", "timeout", ("pg", None))],
    "create_group": _always(
        ("ranks", None),
        ("timeout", None),
        ("backend", None),
        ("pg_options", None),
        ("use_local_synchronization", False),
        ("group_desc", None),
    ),
    "generate_masked_orthogonal_rank_groups": _always("world_size", "parallel_size", "mask"),
    "create_hierarchical_groups": _always(
        "rank",
        "ranks",
        "hierarchical_group_sizes",
        ("create_gloo_process_groups", False),
        ("pg_options", None),
        ("timeout", None),
        ("group_desc", None),
    ),
    "create_hybrid_dp_cp_groups": [_v("0.16", "0.19", "rank", "ranks", "pg_options")],
    "default_embedding_ranks": _always("pp_ranks"),
    "default_position_embedding_ranks": _always("pp_ranks"),
    "overwrite_nccl_comm_cfgs": _always("nccl_comm_cfgs", "pg_name", "key_value_pair"),
    "initialize_model_parallel": [
        Variant("0.14", "0.15", INIT_014),
        Variant("0.16", "0.16", INIT_016),
        Variant("0.17", "0.17", INIT_017),
        Variant("0.18", "0.18", INIT_018),
        Variant("0.19", "0.19", INIT_019),
    ],
    "create_all_gather_groups": [
        _v("0.18", "0.19", ("for_expert_parallelism", False), ("timeout", None), ("nccl_comm_cfgs", None))
    ],
    "is_initialized": _always(),
    "is_unitialized": [_v("0.14", "0.16")],
    "model_parallel_is_initialized": _always(),
    "get_model_parallel_group": _always(_CHECK),
    "get_tensor_model_parallel_group": _always(_CHECK),
    "get_pipeline_model_parallel_group": _always(_CHECK),
    "get_gtp_weight_remat_group": [_v("0.19", "0.19", _CHECK)],
    "get_gtp_weight_remat_world_size": [_v("0.19", "0.19")],
    "get_gtp_weight_remat_rank": [_v("0.19", "0.19")],
    "get_gtp_weight_remat_global_ranks": [_v("0.19", "0.19", _CHECK)],
    "get_data_parallel_group": [
        _v("0.14", "0.15", ("with_context_parallel", False), ("partial_data_parallel", False)),
        _v(
            "0.16",
            "0.17",
            ("with_context_parallel", False),
            ("partial_data_parallel", False),
            ("independent_all_gather", False),
        ),
        _v("0.18", "0.18", ("with_context_parallel", False), ("partial_data_parallel", False)),
        _v(
            "0.19", "0.19", ("with_context_parallel", False), ("with_gtp_remat", True), ("partial_data_parallel", False)
        ),
    ],
    "has_separate_all_gather_group": [_v("0.16", "0.17")],
    "get_data_parallel_group_gloo": _always(("with_context_parallel", False), ("partial_data_parallel", False)),
    "get_context_parallel_group": _always(_CHECK),
    "get_context_parallel_global_ranks": _always(_CHECK),
    "get_hierarchical_context_parallel_groups": _always(_CHECK),
    "get_hybrid_data_context_parallel_groups": [_v("0.16", "0.19", _CHECK, ("group_size", None))],
    "get_embedding_group": _always(_CHECK),
    "get_position_embedding_group": _always(_CHECK),
    "get_amax_reduction_group": _always(("with_context_parallel", False), ("tp_only_amax_red", False)),
    "get_tensor_and_data_parallel_group": [
        _v("0.14", "0.14", ("with_context_parallel", False)),
        _v("0.15", "0.19", _CHECK, ("with_context_parallel", False)),
    ],
    "get_tensor_and_context_parallel_group": _always(_CHECK),
    "set_tensor_model_parallel_world_size": _always("world_size"),
    "set_pipeline_model_parallel_world_size": _always("world_size"),
    "set_virtual_pipeline_model_parallel_world_size": _always("world_size"),
    "get_tensor_model_parallel_world_size": _always(),
    "get_pipeline_model_parallel_world_size": _always(),
    "set_tensor_model_parallel_rank": _always("rank"),
    "set_pipeline_model_parallel_rank": _always("rank"),
    "get_tensor_model_parallel_rank": _always(),
    "get_pipeline_model_parallel_rank": _always(),
    "is_pipeline_first_stage": _always(("ignore_virtual", True), ("vp_stage", None)),
    "is_pipeline_last_stage": _always(("ignore_virtual", True), ("vp_stage", None)),
    "is_rank_in_embedding_group": _always(("ignore_virtual", True), ("vp_stage", None)),
    "is_rank_in_position_embedding_group": _always(),
    "get_virtual_pipeline_model_parallel_rank": _always(),
    "set_virtual_pipeline_model_parallel_rank": _always("rank"),
    "get_virtual_pipeline_model_parallel_world_size": _always(),
    "get_tensor_model_parallel_src_rank": _always(),
    "get_model_parallel_src_rank": _always(),
    "get_data_parallel_src_rank": _always(("with_context_parallel", False)),
    "get_pipeline_model_parallel_first_rank": _always(),
    "get_pipeline_model_parallel_last_rank": _always(),
    "get_pipeline_model_parallel_next_rank": _always(),
    "get_pipeline_model_parallel_prev_rank": _always(),
    "get_data_parallel_world_size": [
        _v("0.14", "0.18", ("with_context_parallel", False), ("partial_data_parallel", False)),
        _v(
            "0.19", "0.19", ("with_context_parallel", False), ("with_gtp_remat", True), ("partial_data_parallel", False)
        ),
    ],
    "set_data_parallel_rank": _always("rank"),
    "get_data_parallel_rank": [
        _v("0.14", "0.18", ("with_context_parallel", False), ("partial_data_parallel", False)),
        _v(
            "0.19", "0.19", ("with_context_parallel", False), ("with_gtp_remat", True), ("partial_data_parallel", False)
        ),
    ],
    "get_context_parallel_world_size": _always(),
    "get_context_parallel_rank": _always(),
    "get_tensor_and_context_parallel_world_size": _always(),
    "get_tensor_and_context_parallel_rank": _always(),
    "get_expert_gtp_weight_remat_group": [_v("0.19", "0.19", _CHECK)],
    "get_expert_gtp_weight_remat_world_size": [_v("0.19", "0.19")],
    "get_expert_gtp_weight_remat_rank": [_v("0.19", "0.19")],
    "get_expert_gtp_weight_remat_global_ranks": [_v("0.19", "0.19", _CHECK)],
    "get_expert_model_parallel_group": _always(_CHECK),
    "get_expert_model_parallel_src_rank": [_v("0.16", "0.19")],
    "get_expert_model_parallel_world_size": _always(),
    "set_expert_model_parallel_world_size": _always("world_size"),
    "get_expert_model_parallel_rank": _always(),
    "set_expert_model_parallel_rank": _always("rank"),
    "get_expert_tensor_parallel_group": _always(_CHECK),
    "get_expert_tensor_parallel_world_size": _always(),
    "set_expert_tensor_parallel_world_size": _always("world_size"),
    "get_expert_tensor_parallel_rank": _always(),
    "set_expert_tensor_parallel_rank": _always("rank"),
    "get_expert_tensor_and_model_parallel_group": _always(_CHECK),
    "get_expert_tensor_and_model_parallel_world_size": _always(),
    "get_expert_tensor_and_model_parallel_rank": _always(),
    "get_expert_tensor_model_pipeline_parallel_group": [
        _v("0.14", "0.18", _CHECK),
        _v("0.19", "0.19", _CHECK, ("with_egtp_remat", False)),
    ],
    "get_expert_data_parallel_group": [
        _v("0.14", "0.18", _CHECK, ("partial_expert_data_parallel", False)),
        _v("0.19", "0.19", _CHECK, ("with_gtp_remat", True), ("partial_expert_data_parallel", False)),
    ],
    "get_data_modulo_expert_parallel_group": [_v("0.14", "0.16", ("partial_expert_data_parallel", False))],
    "get_expert_data_parallel_group_gloo": _always(("partial_expert_data_parallel", False)),
    "get_expert_data_parallel_rank": [
        _v("0.14", "0.18", ("partial_expert_data_parallel", False)),
        _v("0.19", "0.19", ("with_gtp_remat", True), ("partial_expert_data_parallel", False)),
    ],
    "get_expert_data_parallel_world_size": [
        _v("0.14", "0.18", ("partial_expert_data_parallel", False)),
        _v("0.19", "0.19", ("with_gtp_remat", True), ("partial_expert_data_parallel", False)),
    ],
    "get_intra_distributed_optimizer_instance_group": [_v("0.14", "0.14"), _v("0.15", "0.19", _CHECK)],
    "get_inter_distributed_optimizer_instance_group": [_v("0.14", "0.14"), _v("0.15", "0.19", _CHECK)],
    "get_global_memory_buffer": _always(),
    "get_global_symmetric_memory_buffer": [_v("0.16", "0.16")],
    "destroy_global_memory_buffer": _always(),
    "destroy_global_symmetric_memory_buffer": [_v("0.16", "0.16")],
    "get_all_ranks": _always(),
    "destroy_model_parallel": _always(),
}

#: name -> (first series, last series, value at import: ``None`` or ``dict`` for an empty dict).
GLOBALS: dict[str, tuple[str, str, type | None]] = {
    **{
        name: (*_ALL, None)
        for name in (
            "_TENSOR_MODEL_PARALLEL_GROUP",
            "_PIPELINE_MODEL_PARALLEL_GROUP",
            "_MODEL_PARALLEL_GROUP",
            "_EMBEDDING_GROUP",
            "_POSITION_EMBEDDING_GROUP",
            "_DATA_PARALLEL_GROUP",
            "_DATA_PARALLEL_GROUP_GLOO",
            "_TENSOR_AND_DATA_PARALLEL_GROUP",
            "_EXPERT_MODEL_PARALLEL_GROUP",
            "_EXPERT_TENSOR_PARALLEL_GROUP",
            "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
            "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
            "_EXPERT_DATA_PARALLEL_GROUP",
            "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
            "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
            "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
            "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
            "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE",
            "_MPU_EXPERT_MODEL_PARALLEL_RANK",
            "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE",
            "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
            "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
            "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
            "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
            "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
            "_MPU_DATA_PARALLEL_WORLD_SIZE",
            "_MPU_DATA_PARALLEL_RANK",
            "_MPU_TENSOR_MODEL_PARALLEL_RANK",
            "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
            "_EMBEDDING_GLOBAL_RANKS",
            "_POSITION_EMBEDDING_GLOBAL_RANKS",
            "_PIPELINE_GLOBAL_RANKS",
            "_DATA_PARALLEL_GLOBAL_RANKS",
            "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
            "_MODEL_PARALLEL_GLOBAL_RANKS",
            "_CONTEXT_PARALLEL_GROUP",
            "_CONTEXT_PARALLEL_GLOBAL_RANKS",
            "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
            "_DATA_PARALLEL_GROUP_WITH_CP",
            "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
            "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
            "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
            "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
            "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
            "_GLOBAL_MEMORY_BUFFER",
        )
    },
    "_global_process_group_list": ("0.15", "0.19", None),
    "_EXPERT_MODEL_PARALLEL_RANKS": ("0.16", "0.19", None),
    "_HYBRID_DP_CP_GROUPS": ("0.16", "0.19", dict),
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": ("0.16", "0.17", None),
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": ("0.16", "0.16", None),
    **{
        name: ("0.19", "0.19", None)
        for name in (
            "_GTP_WEIGHT_REMAT_GROUP",
            "_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
            "_EXPERT_GTP_WEIGHT_REMAT_GROUP",
            "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
            "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
            "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
            "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
            "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
            "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
        )
    },
}

#: RankGenerator method -> signature variants (``self`` left out).
RANK_GENERATOR: dict[str, list[Variant]] = {
    "__init__": [
        _v("0.14", "0.18", "tp", "ep", "dp", "pp", "cp", "order", ("rank_offset", 0)),
        _v("0.19", "0.19", "tp", "ep", "dp", "pp", "cp", "order", ("rank_offset", 0), ("gtp_remat", 1)),
    ],
    "get_mask": _always("order", "token"),
    "get_ranks": _always("token"),
    "get_gtp_ranks": [_v("0.19", "0.19", "gtp_remat_size")],
}

# ------------------------------------------------------------- legacy releases 0.12 and 0.13
# Their facts are in .legacy (a 0.14 entry is in 0.12/0.13 too unless stated there); merged here.


def _add_legacy() -> None:
    """Extend FUNCTIONS, GLOBALS, RANK_GENERATOR to 0.12/0.13 (module order kept)."""

    def first_since(name: str) -> str:
        return "0.13" if name in _legacy.FIRST_IN_013 else KNOWN_SERIES[0]

    def extend(table: dict[str, list[Variant]], legacy_variants: dict[str, list]) -> None:
        for name, variants in table.items():
            first = variants[0]
            if first.since != _MODERN_FIRST:
                continue
            legacy = [_v(*spec) for spec in legacy_variants.get(name, [])]
            since = _next(legacy[-1].until) if legacy else first_since(name)
            variants[:] = [*legacy, Variant(since, first.until, first.params), *variants[1:]]

    extend(FUNCTIONS, _legacy.LEGACY_VARIANTS)
    extend(RANK_GENERATOR, {})
    ordered = list(FUNCTIONS.items())
    for name, (after, specs) in _legacy.LEGACY_ONLY.items():
        position = next(i for i, (n, _) in enumerate(ordered) if n == after) + 1
        ordered.insert(position, (name, [_v(*spec) for spec in specs]))
    FUNCTIONS.clear()
    FUNCTIONS.update(ordered)
    for name, (since, until, init) in list(GLOBALS.items()):
        if since == _MODERN_FIRST:
            GLOBALS[name] = (first_since(name), until, init)
    GLOBALS.update(_legacy.LEGACY_GLOBALS)


_add_legacy()
