"""The tables behind the porting tool: Megatron's parallel_state names and their equivalents.

Which group kind (of :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout` and
``compat.parallel_state.get_state().groups``) each getter reads, which keyword variants pick
another kind, the names ``compat.parallel_state`` has, and the named-grid spelling of a kind.
The tool: docs/tools.md#port-tool.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

PARALLEL_STATE = "megatron.core.parallel_state"
MEGATRON_CORE = "megatron.core"
COMPAT_PARALLEL_STATE = "compat.parallel_state"
# ``megatron.core.mpu`` is an attribute alias of parallel_state (``from megatron.core import mpu``).
_MODULE_ALIASES = {"megatron.core.mpu": PARALLEL_STATE}
_PS_NAMES_IN_CORE = ("parallel_state", "mpu")

# Getter -> (group kind, what the getter returns of that kind's group). Kinds are those of
# MegatronLayout / ParallelState.groups (``_gloo`` = the gloo twin). The accessor says which
# expression of the named grid is equivalent: the group, this rank's position in it, its size,
# its global ranks, or one of them.
NAMED_GRID_GETTERS: dict[str, tuple[str, str]] = {
    # groups
    "get_model_parallel_group": ("mp", "group"),
    "get_tensor_model_parallel_group": ("tp", "group"),
    "get_pipeline_model_parallel_group": ("pp", "group"),
    "get_data_parallel_group": ("dp", "group"),
    "get_data_parallel_group_gloo": ("dp_gloo", "group"),
    "get_context_parallel_group": ("cp", "group"),
    "get_embedding_group": ("embd", "group"),
    "get_position_embedding_group": ("pos_embd", "group"),
    "get_tensor_and_data_parallel_group": ("tp_dp", "group"),
    "get_tensor_and_context_parallel_group": ("tp_cp", "group"),
    "get_amax_reduction_group": ("tp_dp", "group"),
    "get_expert_model_parallel_group": ("ep", "group"),
    "get_expert_tensor_parallel_group": ("ep_tp", "group"),
    "get_expert_tensor_and_model_parallel_group": ("tp_ep_mp", "group"),
    "get_expert_tensor_model_pipeline_parallel_group": ("tp_ep_pp", "group"),
    "get_expert_data_parallel_group": ("ep_dp", "group"),
    "get_data_modulo_expert_parallel_group": ("ep_dp", "group"),
    "get_expert_data_parallel_group_gloo": ("ep_dp_gloo", "group"),
    "get_intra_distributed_optimizer_instance_group": ("intra_dist_opt_instance", "group"),
    "get_inter_distributed_optimizer_instance_group": ("inter_ep_dp", "group"),
    # this rank's position in a group
    "get_tensor_model_parallel_rank": ("tp", "rank"),
    "get_pipeline_model_parallel_rank": ("pp", "rank"),
    "get_data_parallel_rank": ("dp", "rank"),
    "get_context_parallel_rank": ("cp", "rank"),
    "get_tensor_and_context_parallel_rank": ("tp_cp", "rank"),
    "get_expert_model_parallel_rank": ("ep", "rank"),
    "get_expert_tensor_parallel_rank": ("ep_tp", "rank"),
    "get_expert_tensor_and_model_parallel_rank": ("tp_ep_mp", "rank"),
    "get_expert_data_parallel_rank": ("ep_dp", "rank"),
    # group sizes
    "get_tensor_model_parallel_world_size": ("tp", "size"),
    "get_pipeline_model_parallel_world_size": ("pp", "size"),
    "get_data_parallel_world_size": ("dp", "size"),
    "get_context_parallel_world_size": ("cp", "size"),
    "get_tensor_and_context_parallel_world_size": ("tp_cp", "size"),
    "get_expert_model_parallel_world_size": ("ep", "size"),
    "get_expert_tensor_parallel_world_size": ("ep_tp", "size"),
    "get_expert_tensor_and_model_parallel_world_size": ("tp_ep_mp", "size"),
    "get_expert_data_parallel_world_size": ("ep_dp", "size"),
    # global ranks
    "get_context_parallel_global_ranks": ("cp", "ranks"),
    "get_tensor_model_parallel_src_rank": ("tp", "first"),
    "get_model_parallel_src_rank": ("mp", "first"),
    "get_data_parallel_src_rank": ("dp", "first"),
    "get_expert_model_parallel_src_rank": ("ep", "first"),
    "get_pipeline_model_parallel_first_rank": ("pp", "first"),
    "get_pipeline_model_parallel_last_rank": ("pp", "last"),
}

# Getter -> ((keyword arguments that must all be True, kind), ...), most specific first; the
# table's kind applies when none matches.
_DP_VARIANTS = (
    (("with_context_parallel", "partial_data_parallel"), "intra_dp_cp"),
    (("with_context_parallel",), "dp_cp"),
)
GETTER_VARIANTS: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "get_data_parallel_group": _DP_VARIANTS,
    "get_data_parallel_group_gloo": (
        (("with_context_parallel", "partial_data_parallel"), "intra_dp_cp_gloo"),
        (("with_context_parallel",), "dp_cp_gloo"),
    ),
    "get_data_parallel_rank": _DP_VARIANTS,
    "get_data_parallel_world_size": _DP_VARIANTS,
    "get_data_parallel_src_rank": ((("with_context_parallel",), "dp_cp"),),
    "get_tensor_and_data_parallel_group": ((("with_context_parallel",), "tp_dp_cp"),),
    "get_amax_reduction_group": (
        (("with_context_parallel", "tp_only_amax_red"), "tp_cp"),
        (("with_context_parallel",), "tp_dp_cp"),
        (("tp_only_amax_red",), "tp"),
    ),
    "get_expert_data_parallel_group": ((("partial_expert_data_parallel",), "intra_ep_dp"),),
    "get_data_modulo_expert_parallel_group": ((("partial_expert_data_parallel",), "intra_ep_dp"),),
    "get_expert_data_parallel_group_gloo": ((("partial_expert_data_parallel",), "intra_ep_dp_gloo"),),
    "get_expert_data_parallel_rank": ((("partial_expert_data_parallel",), "intra_ep_dp"),),
    "get_expert_data_parallel_world_size": ((("partial_expert_data_parallel",), "intra_ep_dp"),),
}

# Partial (per distributed-optimizer instance) kinds collapse to the full ones with one instance.
_SINGLE_INSTANCE_KIND = {
    "intra_dp_cp": "dp_cp",
    "intra_dp_cp_gloo": "dp_cp_gloo",
    "intra_ep_dp": "ep_dp",
    "intra_ep_dp_gloo": "ep_dp_gloo",
}

_ACCESSOR = {
    "group": 'get_state().groups["{kind}"]',
    "rank": 'get_state().groups["{kind}"].rank()',
    "size": 'get_state().groups["{kind}"].size()',
    "ranks": 'get_state().ranks["{kind}"]',
    "first": 'get_state().ranks["{kind}"][0]',
    "last": 'get_state().ranks["{kind}"][-1]',
}
_ACCESSOR_WORDS = {
    "group": "{kind} group",
    "rank": "position in the {kind} group",
    "size": "size of the {kind} group",
    "ranks": "global ranks of the {kind} group",
    "first": "first rank of the {kind} group",
    "last": "last rank of the {kind} group",
}


# --------------------------------------------------------------------------- compat's API
@functools.cache
def compat_api() -> frozenset[str]:
    """Names of ``compat.parallel_state``: its public functions and classes and its ``_`` globals.

    Imported lazily (compat imports torch). Typing helpers and stdlib objects that only happen
    to sit in the module's namespace are left out.
    """
    import compat.parallel_state as ps

    names = set()
    for name, obj in vars(ps).items():
        if name.startswith("__") or inspect.ismodule(obj) or type(obj).__name__ == "_Feature":
            continue
        if callable(obj):
            if getattr(obj, "__module__", "").split(".")[0] in ("compat", "parallel_state_ng"):
                names.add(name)
        elif name.startswith("_"):
            names.add(name)
    return frozenset(names)


@functools.cache
def _published_globals() -> dict[str, tuple[str, str]]:
    """Module globals of the served release that mirror one kind's group or rank list.

    Read from the group-kind table; globals that alias another kind (``fallback``) or hold
    several groups (hierarchical levels, hybrid sizes) have no single named-grid equivalent.
    """
    from parallel_state_ng.layout.kinds import fills
    from parallel_state_ng.releases import current_release
    from parallel_state_ng.releases.parallel_state import globals_of

    served = globals_of(current_release())
    out: dict[str, tuple[str, str]] = {}
    for kind, fill in fills():
        if fill.name not in served or fill.fallback is not None or fill.value in ("levels", "by_size"):
            continue
        key = f"{kind.name}_gloo" if fill.value == "gloo" else kind.name
        out[fill.name] = (key, "ranks" if fill.value == "ranks" else "group")
    return out


def _kind_words(kind: str) -> str:
    from parallel_state_ng.layout.kinds import GROUP_KINDS

    base = kind[: -len("_gloo")] if kind.endswith("_gloo") else kind
    what = GROUP_KINDS[base].what if base in GROUP_KINDS else base
    return what + (" (gloo twin)" if base != kind else "")


def named_grid_equivalent(kind: str, accessor: str, alternatives: Sequence[tuple[str, str]] = ()) -> str:
    """The named-grid spelling of (``kind``, ``accessor``) with a short description.

    ``alternatives`` are (condition, kind) pairs when the kind depends on an argument value
    the scanner could not read.
    """
    expr = f"{COMPAT_PARALLEL_STATE}.{_ACCESSOR[accessor].format(kind=kind)}"
    words = _ACCESSOR_WORDS[accessor].format(kind=kind) + f" of MegatronLayout: {_kind_words(kind)}"
    if kind in _SINGLE_INSTANCE_KIND:
        words += f"; {_SINGLE_INSTANCE_KIND[kind]!r} with one distributed-optimizer instance"
    for condition, other in alternatives:
        words += f"; {other!r} with {condition}"
    return f"named grid: {expr} ({words})"
