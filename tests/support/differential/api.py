"""The reference API of the differential library (:mod:`tests.support.differential.library`).

Which functions and globals ``megatron.core.parallel_state`` of this process has (the
installed Megatron-Core, or the release ``tests.support.releases.binding.activate`` bound the
process to), how they split into getters and setters, and every getter call a snapshot makes
(argument values keyed by parameter name). Nothing here is written per release.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import megatron.core.parallel_state as mcore_ps

# The list of getters, setters and globals is derived from the *reference* module — the
# ``megatron.core.parallel_state`` importable in this process: the installed Megatron-Core, or,
# inside a process bound to another release by ``tests.support.releases.binding.activate``, that release
# — never from the module under test. A getter the reference has and the tested module lacks
# shows up as a ``("missing",)`` value, and a getter added to a newer Megatron-Core that this
# library does not know how to call raises :class:`UnknownApiError`. Nothing here is written per
# release: parameter values are keyed by parameter name, the functions to call come from the
# reference's own namespace, pristine globals from the reference at import time.

MISSING = ("missing",)
ABSENT = ("absent",)


class UnknownApiError(RuntimeError):
    """The reference module has a public function this library does not know how to call."""


# --------------------------------------------------------------------------- the reference API


def reference_functions() -> dict[str, Callable]:
    """Public functions defined in the installed ``megatron.core.parallel_state``, in order."""
    return {
        name: obj
        for name, obj in vars(mcore_ps).items()
        if inspect.isfunction(obj) and obj.__module__ == mcore_ps.__name__ and not name.startswith("_")
    }


def reference_globals() -> list[str]:
    """Module-level state of the reference: ``_``-names that are not functions/classes/modules."""
    names = []
    for name, obj in vars(mcore_ps).items():
        if not name.startswith("_") or name.startswith("__"):
            continue
        if inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
            continue
        if type(obj).__module__ == "typing":
            continue
        names.append(name)
    return names


# Public functions that are not state getters, with the reason they are not called by
# :func:`snapshot`, for every supported release (a release lacks some of them; a name that no
# supported release has is reported as stale by the per-release test, which sees them all).
NOT_GETTERS: dict[str, str] = {
    "initialize_model_parallel": "the initializer itself",
    "destroy_model_parallel": "mutator; exercised by the harness",
    "destroy_global_memory_buffer": "mutator; exercised in the setter phase",
    "destroy_global_symmetric_memory_buffer": "mutator; exercised in the setter phase",
    "get_nccl_options": "stateless helper (pg_name, cfgs); compared by the helper tests",
    "update_pg_timeout": "collective + torch.cuda; compared by the helper tests",
    "create_group": "creates a group; compared by the helper tests",
    "generate_masked_orthogonal_rank_groups": "stateless helper; compared by the helper tests",
    "create_hierarchical_groups": "creates groups; compared by the helper tests",
    "create_hierarchical_parallel_groups": "creates groups (0.12); compared by the helper tests",
    "create_hybrid_dp_cp_groups": "creates groups; compared by the helper tests",
    "default_embedding_ranks": "stateless helper; compared by the helper tests",
    "default_position_embedding_ranks": "stateless helper; compared by the helper tests",
    "overwrite_nccl_comm_cfgs": "stateless helper; compared by the helper tests",
    "create_all_gather_groups": "creates groups after init (0.18+); exercised by observe(after_init=...)",
}

GETTER_PREFIXES = ("get_", "is_", "has_", "model_parallel_is_initialized")

# Values tried for each keyword parameter a getter may take.
_BOOL = (False, True)
VP_STAGES = (None, 0, 1, 2, 3)
# A pipeline rank (0.12/0.13 is_pipeline_stage_before/after_split, is_inside_encoder/decoder):
# the caller's own (None), and stages on both sides of a split rank or decoder start.
PIPELINE_RANKS = (None, 0, 1, 2, 3)


def _param_values(world_size: int) -> dict[str, tuple]:
    sizes = {None, 1, 3, world_size}
    p = 2
    while p <= 2 * world_size:
        sizes.add(p)
        p *= 2
    return {
        "check_initialized": (True, False),
        "with_context_parallel": _BOOL,
        "partial_data_parallel": _BOOL,
        "independent_all_gather": _BOOL,
        "tp_only_amax_red": _BOOL,
        "partial_expert_data_parallel": _BOOL,
        "with_gtp_remat": _BOOL,
        "with_egtp_remat": _BOOL,
        "ignore_virtual": (True, False),
        "vp_stage": VP_STAGES,
        "rank": PIPELINE_RANKS,
        "group_size": tuple(sorted(sizes, key=lambda s: -1 if s is None else s)),
    }


# Setters and the value each is set to in the setter phase (all are reset to None after).
SETTER_VALUES: dict[str, Any] = {
    "set_tensor_model_parallel_world_size": 7,
    "set_pipeline_model_parallel_world_size": 5,
    "set_virtual_pipeline_model_parallel_world_size": 3,
    "set_tensor_model_parallel_rank": 1,
    "set_pipeline_model_parallel_rank": 1,
    "set_virtual_pipeline_model_parallel_rank": 2,
    "set_data_parallel_rank": 3,
    "set_expert_model_parallel_world_size": 6,
    "set_expert_model_parallel_rank": 2,
    "set_expert_tensor_parallel_world_size": 4,
    "set_expert_tensor_parallel_rank": 1,
    "set_pipeline_model_parallel_split_rank": 2,  # 0.12/0.13
}


@dataclass
class Call:
    """One getter call: function name and keyword arguments."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


def classify_functions() -> tuple[list[str], list[str]]:
    """Split the reference's public functions into (getters, setters); fail on anything else."""
    functions = reference_functions()
    getters, setters = [], []
    for name in functions:
        if name in NOT_GETTERS:
            continue
        if name.startswith("set_"):
            if name not in SETTER_VALUES:
                raise UnknownApiError(f"setter {name} has no value in SETTER_VALUES")
            setters.append(name)
        elif name.startswith(GETTER_PREFIXES):
            getters.append(name)
        else:
            raise UnknownApiError(
                f"public function {name}{inspect.signature(functions[name])} is neither a getter "
                "(get_/is_/has_), a setter, nor listed in NOT_GETTERS: teach tests/support/differential/api.py"
            )
    return getters, setters


@functools.cache
def getter_calls(world_size: int) -> tuple[Call, ...]:
    """Every getter call :func:`snapshot` makes: the no-argument call and every combination."""
    getters, _ = classify_functions()
    values = _param_values(world_size)
    functions = reference_functions()
    calls: list[Call] = []
    for name in getters:
        params = list(inspect.signature(functions[name]).parameters.values())
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise UnknownApiError(f"{name} takes *{p.name}: teach tests/support/differential/api.py")
            if p.name not in values:
                raise UnknownApiError(
                    f"getter {name} has parameter {p.name!r} with no known values: teach "
                    "tests/support/differential/library.py (_param_values)"
                )
        calls.append(Call(name))
        names = [p.name for p in params]
        for combo in itertools.product(*(values[n] for n in names)):
            if names:
                calls.append(Call(name, dict(zip(names, combo))))
    return tuple(calls)
