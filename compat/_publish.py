"""Which module global of ``compat.parallel_state`` mirrors which part of the state object.

:func:`publish` writes a :class:`~parallel_state_ng.groups.megatron_groups.ModelParallelGroups`
into the served release's module globals, reading the group-kind table
(:data:`parallel_state_ng.layout.kinds.GROUP_KINDS`); the getters read the globals, as MCore's do.
"""

from __future__ import annotations

from typing import Any

from parallel_state_ng.groups.megatron_groups import ModelParallelGroups, global_values
from parallel_state_ng.layout.kinds import fills
from parallel_state_ng.releases import parallel_state as api

from ._release import RELEASE

__all__ = [
    "OVERRIDE_GLOBALS",
    "BLOCK_OVERRIDES",
    "STATE_EXTRAS",
    "state_globals",
    "global_values",
    "publish",
]

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
# Globals that belong to one grid but are not kept in its ModelParallelGroups.
STATE_EXTRAS = (
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_GLOBAL_MEMORY_BUFFER",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
)
BUFFER_GLOBALS = ("_GLOBAL_MEMORY_BUFFER", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER")


def state_globals(ns: dict[str, Any]) -> list[str]:
    """The globals of ``ns`` that ``initialize_model_parallel`` sets and destroy resets."""
    names = [fill.name for _, fill in fills()] + list(_OTHER_STATE)
    return [name for name in dict.fromkeys(names) if name in ns]


def publish(ns: dict[str, Any], state: ModelParallelGroups | None) -> None:
    """Mirror ``state`` into the module globals ``ns`` (``None``: reset them to their import values).

    Only globals ``ns`` has (those of the served release) are written.
    """
    initial = api.globals_of(RELEASE)  # import-time values: None, dict or list
    names = state_globals(ns)
    values = global_values(state, {name: None if (init := initial.get(name)) is None else init() for name in names})
    for name in names:
        ns[name] = values[name]
