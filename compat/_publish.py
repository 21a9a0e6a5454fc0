"""Which module global of ``compat.parallel_state`` mirrors which part of the state object.

``initialize_model_parallel`` builds one :class:`compat._state.ParallelState`; :func:`publish`
writes it into the module globals MCore has (only those the served release has), and the
getters read the globals, as MCore's do.
"""

from __future__ import annotations

from typing import Any, Optional

from parallel_state_ng.mcore.releases import parallel_state as api

from ._state import ParallelState

__all__ = [
    "GROUP_GLOBALS",
    "RANK_GLOBALS",
    "OVERRIDE_GLOBALS",
    "BLOCK_OVERRIDES",
    "STATE_EXTRAS",
    "state_globals",
    "publish",
]

# global -> state key of the group it holds.
GROUP_GLOBALS: dict[str, str] = {
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": "dp_cp_ag",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp_gloo",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_GLOO": "dp_gloo",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "ep_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep_mp",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "ep_dp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "ep_dp_gloo",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter_ep_dp",
    "_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "inter_dp_cp",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt_instance",
    "_GTP_WEIGHT_REMAT_GROUP": "gtp_remat",
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP": "expt_gtp_remat",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "tp_ep_gtp_remat_pp",
}
# global -> state key of the rank list it holds.
RANK_GLOBALS: dict[str, str] = {
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "gtp_remat",
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "expt_gtp_remat",
}
# global -> (state key used with several distributed-optimizer instances, key otherwise).
_PARTIAL_GLOBALS: dict[str, tuple[str, str]] = {
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("intra_dp_cp", "dp_cp"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": ("intra_dp_cp_gloo", "dp_cp_gloo"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": ("intra_ep_dp", "ep_dp"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": ("intra_ep_dp_gloo", "ep_dp_gloo"),
}
# 0.19 data-distribution globals: the group spanning the GTP axis when it was built (GTP size
# > 1), else the global it aliases.
_GTP_GLOBALS: dict[str, tuple[str, str]] = {
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("gtp_remat_dp", "_DATA_PARALLEL_GROUP"),
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": ("gtp_remat_dp_cp", "_DATA_PARALLEL_GROUP_WITH_CP"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": (
        "gtp_remat_dp_cp", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"
    ),
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("ep_gtp_remat_dp", "_EXPERT_DATA_PARALLEL_GROUP"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": (
        "ep_gtp_remat_dp", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP"
    ),
}
_OTHER_STATE = (
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "_PIPELINE_MODEL_PARALLEL_DECODER_START",
    "_HYBRID_DP_CP_GROUPS",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_global_process_group_list",
)
# Values set through set_*() that MCore's destroy_model_parallel clears as well.
OVERRIDE_GLOBALS = (
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
)
# set_*() overrides, per use_state block (destroy keeps the data-parallel ones, as MCore does).
BLOCK_OVERRIDES = (*OVERRIDE_GLOBALS, "_MPU_DATA_PARALLEL_RANK", "_MPU_DATA_PARALLEL_WORLD_SIZE")
# Globals that belong to one grid but are not kept in its ParallelState.
STATE_EXTRAS = (
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_GLOBAL_MEMORY_BUFFER",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
)
BUFFER_GLOBALS = ("_GLOBAL_MEMORY_BUFFER", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER")


def state_globals(ns: dict[str, Any]) -> list[str]:
    """The globals of ``ns`` that ``initialize_model_parallel`` sets and destroy resets."""
    names = [*GROUP_GLOBALS, *RANK_GLOBALS, *_PARTIAL_GLOBALS, *_GTP_GLOBALS, *_OTHER_STATE]
    return [name for name in names if name in ns]


def publish(ns: dict[str, Any], state: Optional[ParallelState]) -> None:
    """Mirror ``state`` into the module globals ``ns`` (``None``: reset them to their import values).

    Only globals ``ns`` has (those of the served release) are written.
    """
    initial = api.globals_of(ns["MEGATRON_RELEASE"])  # import-time values: None, dict or list
    values: dict[str, Any] = {name: None if initial.get(name) is None else initial[name]() for name in state_globals(ns)}
    if state is not None:
        g = state.groups
        values.update({name: g.get(key) for name, key in GROUP_GLOBALS.items()})
        values.update({name: state.ranks.get(key) for name, key in RANK_GLOBALS.items()})
        partial = state.layout.num_distributed_optimizer_instances > 1
        values.update({name: g.get(keys[0] if partial else keys[1]) for name, keys in _PARTIAL_GLOBALS.items()})
        for name, (key, alias) in _GTP_GLOBALS.items():
            values[name] = g[key] if key in g else values[alias]
        if state.hierarchical_cp_groups is not None:
            values["_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"] = state.hierarchical_cp_groups
        # 0.12-0.13: the first decoder stage of a pipeline that starts with an encoder
        values["_PIPELINE_MODEL_PARALLEL_DECODER_START"] = state.layout.encoder_pipeline_model_parallel_size or None
        values["_HYBRID_DP_CP_GROUPS"] = dict(state.hybrid_dp_cp_groups)
        values["_global_process_group_list"] = state.process_group_list
    for name, value in values.items():
        if name in ns:
            ns[name] = value
