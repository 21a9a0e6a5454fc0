"""Differential-testing library: everything observable about a ``parallel_state`` module.

A module ``ps`` with Megatron-Core's ``parallel_state`` API (MCore itself, or
``compat.parallel_state``) is observed through a *snapshot*: a flat ``dict`` from a key (a getter
call with its arguments, a module global, ...) to a plain, comparable value (:func:`encode`); two
snapshots taken in the same situation (fake-backend world, rank, init arguments) compare with
:func:`compare`. One namespace (``from tests.support.differential import library as D``) over
:mod:`~tests.support.differential.api`, :mod:`~tests.support.differential.snapshot`,
:mod:`~tests.support.differential.observe` and :func:`fake_world`.
"""

from __future__ import annotations

from parallel_state_ng.testing.worlds import init_simulated_rank
from tests.support.differential.api import (
    _BOOL,
    ABSENT,
    GETTER_PREFIXES,
    MISSING,
    NOT_GETTERS,
    PIPELINE_RANKS,
    SETTER_VALUES,
    VP_STAGES,
    Call,
    UnknownApiError,
    _param_values,
    classify_functions,
    getter_calls,
    reference_functions,
    reference_globals,
)
from tests.support.differential.observe import (
    BUFFER_FUNCTIONS,
    Observation,
    _after_init_phase,
    _capture_pristine,
    _setter_phase,
    destroy_differences,
    env_diff,
    globals_after_destroy,
    observe,
    preserved_environment,
    pristine_globals,
    reset_mcore,
)
from tests.support.differential.snapshot import (
    _BARRIERS,
    _CREATED,
    _CUDA_CALLS,
    THIRD_PARTY_ERRORS,
    Difference,
    GroupRecord,
    _call,
    _Encoder,
    _getattr,
    _group_metadata,
    _short,
    _timeout_repr,
    compare,
    describe,
    encode,
    equivalent,
    forget_recorded_groups,
    raised,
    recording,
    snapshot,
    snapshot_uninitialized,
)

__all__ = [
    "ABSENT",
    "BUFFER_FUNCTIONS",
    "GETTER_PREFIXES",
    "MISSING",
    "NOT_GETTERS",
    "PIPELINE_RANKS",
    "SETTER_VALUES",
    "THIRD_PARTY_ERRORS",
    "VP_STAGES",
    "Call",
    "Difference",
    "GroupRecord",
    "Observation",
    "UnknownApiError",
    "classify_functions",
    "compare",
    "describe",
    "destroy_differences",
    "encode",
    "env_diff",
    "equivalent",
    "fake_world",
    "forget_recorded_groups",
    "getter_calls",
    "globals_after_destroy",
    "observe",
    "preserved_environment",
    "pristine_globals",
    "raised",
    "recording",
    "reference_functions",
    "reference_globals",
    "reset_mcore",
    "snapshot",
    "snapshot_uninitialized",
    # private helpers that tests and the per-release harness reach for
    "_BARRIERS",
    "_BOOL",
    "_CREATED",
    "_CUDA_CALLS",
    "_Encoder",
    "_after_init_phase",
    "_call",
    "_capture_pristine",
    "_getattr",
    "_group_metadata",
    "_param_values",
    "_setter_phase",
    "_short",
    "_timeout_repr",
]


def fake_world(rank: int, world_size: int) -> None:
    """(Re)initialize the default process group as rank ``rank`` of a fake ``world_size``-rank world."""
    init_simulated_rank(rank, world_size, replace=True)
