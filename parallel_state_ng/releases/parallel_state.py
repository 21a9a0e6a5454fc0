"""Per-release facts about ``megatron.core.parallel_state``: its API surface and behaviour (data).

Read from each release's ``parallel_state.py`` (0.14.0 … 0.19.2); 0.12/0.13 are merged in at
import from :mod:`.parallel_state_legacy`. Tables: :data:`FUNCTIONS`, :data:`GLOBALS`,
:data:`RANK_GENERATOR`, :data:`REPLACEMENTS`; queries: :func:`functions`, :func:`signature`,
:func:`globals_of`, :func:`rank_generator_methods`, :func:`has`, :func:`positional_changes`,
:func:`replacement`. See docs/releases.md.
"""

from __future__ import annotations

import functools
from typing import Any

from parallel_state_ng.releases import KNOWN_SERIES, SUPPORTED_SERIES, Release, known_release
from parallel_state_ng.releases.parallel_state_replacements import REPLACEMENTS, replacement
from parallel_state_ng.releases.parallel_state_variants import REQUIRED, Param, Variant, drop_param, insert_params
from parallel_state_ng.releases.parallel_state_variants import params as _params
from parallel_state_ng.releases.parallel_state_variants import series_after as _next
from parallel_state_ng.releases.parallel_state_variants import variant as _v

__all__ = [
    "REQUIRED",
    "Param",
    "Variant",
    "FUNCTIONS",
    "GLOBALS",
    "RANK_GENERATOR",
    "functions",
    "signature",
    "globals_of",
    "rank_generator_methods",
    "has",
    "positional_changes",
    "GLOBAL_VALUE_EXCEPTIONS",
    "REPLACEMENTS",
    "replacement",
]


# The tables below are written for the modern releases (0.14 on); the legacy 0.12/0.13 entries
# are merged in at the end of the module.
_MODERN_FIRST = "0.14"
_ALL = (_MODERN_FIRST, SUPPORTED_SERIES[-1])


def _always(*spec: str | tuple[str, Any]) -> list[Variant]:
    return [_v(*_ALL, *spec)]


_CHECK = ("check_initialized", True)

# initialize_model_parallel: the 0.14 parameters, then each release's insertions.
_INIT_014 = _params(
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
_INIT_016 = insert_params(_INIT_014, "hierarchical_context_parallel_sizes", ("hybrid_context_parallel", False)) + (
    ("create_all_gather_group", False),
)
# 0.17: rank_offset, local_world_size appended.
_INIT_017 = _INIT_016 + (("rank_offset", 0), ("local_world_size", None))
# 0.18: create_all_gather_group removed (create_all_gather_groups() after init instead).
_INIT_018 = drop_param(_INIT_017, "create_all_gather_group")
# 0.19: gtp_remat_size, expert_gtp_remat_size after expert_model_parallel_size.
_INIT_019 = insert_params(_INIT_018, "expert_model_parallel_size", ("gtp_remat_size", 1), ("expert_gtp_remat_size", 1))

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
        Variant("0.14", "0.15", _INIT_014),
        Variant("0.16", "0.16", _INIT_016),
        Variant("0.17", "0.17", _INIT_017),
        Variant("0.18", "0.18", _INIT_018),
        Variant("0.19", "0.19", _INIT_019),
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
# Their facts are in parallel_state_legacy (a 0.14 entry is in 0.12/0.13 too unless stated
# there); merged here.
from parallel_state_ng.releases import parallel_state_legacy as _legacy  # noqa: E402
from parallel_state_ng.releases.parallel_state_legacy import GLOBAL_VALUE_EXCEPTIONS  # noqa: E402


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


# ----------------------------------------------------------------------------------- queries
def _pick(variants: list[Variant], release: Release) -> Variant | None:
    for variant in variants:
        if variant.covers(release):
            return variant
    return None


def signature(name: str, release: str | Release) -> tuple[Param, ...] | None:
    """The parameters of function ``name`` in ``release``, or ``None`` if it has no such function.

    Raises:
        KeyError: no supported release has ``name``.
    """
    variant = _pick(FUNCTIONS[name], known_release(release))
    return None if variant is None else variant.params


def functions(release: str | Release) -> dict[str, tuple[Param, ...]]:
    """Every public function of ``release`` with its parameters, in MCore's module order."""
    r = known_release(release)
    out = {}
    for name, variants in FUNCTIONS.items():
        variant = _pick(variants, r)
        if variant is not None:
            out[name] = variant.params
    return out


def globals_of(release: str | Release) -> dict[str, type | None]:
    """Every module global of ``release`` -> its import-time value (``None``, or ``dict``: empty dict)."""
    return dict(_globals_of_series(known_release(release).series))


@functools.cache
def _globals_of_series(series: str) -> tuple[tuple[str, type | None], ...]:
    # Cached: compat publishes the globals on every init and destroy (about 130 release
    # comparisons each time otherwise).
    r = known_release(series)
    return tuple(
        (name, GLOBAL_VALUE_EXCEPTIONS.get(name, {}).get(r.series, init))
        for name, (since, until, init) in GLOBALS.items()
        if Variant(since, until, ()).covers(r)
    )


def rank_generator_methods(release: str | Release) -> dict[str, tuple[Param, ...]]:
    """``RankGenerator``'s methods in ``release`` with their parameters (``self`` left out)."""
    r = known_release(release)
    out = {}
    for name, variants in RANK_GENERATOR.items():
        variant = _pick(variants, r)
        if variant is not None:
            out[name] = variant.params
    return out


def has(name: str, release: str | Release) -> bool:
    """Whether ``release``'s API has a function or a function's parameter.

    ``name`` is a function name (``"create_all_gather_groups"``) or ``"function.parameter"``
    (``"initialize_model_parallel.rank_offset"``). Behaviour that changed without a signature
    change is in :mod:`parallel_state_ng.releases.facts`.
    """
    r = known_release(release)
    fact = name
    if fact in FUNCTIONS:
        return signature(fact, r) is not None
    function, _, parameter = fact.partition(".")
    if parameter and function in FUNCTIONS:
        params = signature(function, r)
        return params is not None and parameter in dict(params)
    raise KeyError(f"unknown name {fact!r}: not a function or 'function.parameter' of any known release")


def positional_changes(name: str, old: str | Release, new: str | Release) -> list[tuple[int, str | None, str | None]]:
    """Positions whose parameter differs between ``old`` and ``new`` for function ``name``.

    Returns ``(index, old parameter, new parameter)`` for every position where a positional
    argument would change meaning (``None``: no parameter at that position in that release).
    An empty list means positional calls keep their meaning.

    Raises:
        ValueError: one of the releases has no function ``name``.
    """
    before, after = signature(name, old), signature(name, new)
    if before is None or after is None:
        missing = old if before is None else new
        raise ValueError(f"{name} does not exist in megatron-core {missing}")
    a, b = [n for n, _ in before], [n for n, _ in after]
    return [
        (i, a[i] if i < len(a) else None, b[i] if i < len(b) else None)
        for i in range(max(len(a), len(b)))
        if (a[i] if i < len(a) else None) != (b[i] if i < len(b) else None)
        and i < len(a)  # positions only the new release has cannot be passed by old callers
    ]
