"""Which module global of ``compat.parallel_state`` mirrors which part of the state object.

``initialize_model_parallel`` builds one :class:`compat._state.ParallelState`; :func:`publish`
writes it into the module globals MCore has (only those the served release has), reading the
group-kind table (:data:`parallel_state_ng.mcore.kinds.GROUP_KINDS`: which kind fills which
global, and the aliases), and the getters read the globals, as MCore's do.
"""

from __future__ import annotations

from typing import Any

from parallel_state_ng.mcore.kinds import Fill, fills
from parallel_state_ng.mcore.releases import parallel_state as api

from ._release import RELEASE
from ._state import ParallelState

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
    names = [fill.name for _, fill in fills()] + list(_OTHER_STATE)
    return [name for name in dict.fromkeys(names) if name in ns]


def _fill_value(state: ParallelState, kind: str, fill: Fill) -> Any:
    """What ``fill`` holds for ``state`` (``_UNBUILT`` when the rank did not build ``kind``)."""
    if fill.value == "levels":
        return state.hierarchical_cp_groups
    if fill.value == "by_size":
        return dict(state.hybrid_dp_cp_groups)
    key = f"{kind}_gloo" if fill.value == "gloo" else kind
    table = state.ranks if fill.value == "ranks" else state.groups
    return table[key] if key in table else _UNBUILT


_UNBUILT = object()


def global_values(state: ParallelState | None, initial: dict[str, Any]) -> dict[str, Any]:
    """Every state global's value for ``state`` (``None``: the import-time values ``initial``).

    Each global of the group-kind table takes its kind's group, rank list or gloo twin; for a
    kind this rank did not build it takes the value of the global it falls back to (MCore's
    aliases), else ``None``. The hierarchical context-parallel list keeps its import-time value
    when no hierarchy is configured.
    """
    values = dict(initial)
    if state is None:
        return values
    fallbacks: dict[str, str] = {}
    for kind, fill in fills():
        value = _fill_value(state, kind.name, fill)
        if value is None and fill.value == "levels":
            continue
        if value is _UNBUILT and fill.fallback is not None:
            fallbacks[fill.name] = fill.fallback
        else:
            values[fill.name] = None if value is _UNBUILT else value

    def resolve(name: str) -> Any:
        return resolve(fallbacks[name]) if name in fallbacks else values.get(name)

    values.update({name: resolve(name) for name in fallbacks})
    # 0.12-0.13: the first decoder stage of a pipeline that starts with an encoder
    values["_PIPELINE_MODEL_PARALLEL_DECODER_START"] = state.layout.encoder_pipeline_model_parallel_size or None
    values["_global_process_group_list"] = state.process_group_list
    return values


def publish(ns: dict[str, Any], state: ParallelState | None) -> None:
    """Mirror ``state`` into the module globals ``ns`` (``None``: reset them to their import values).

    Only globals ``ns`` has (those of the served release) are written.
    """
    initial = api.globals_of(RELEASE)  # import-time values: None, dict or list
    names = state_globals(ns)
    values = global_values(state, {name: None if (init := initial.get(name)) is None else init() for name in names})
    for name in names:
        ns[name] = values[name]
