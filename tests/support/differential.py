"""Differential-testing library: everything observable about a ``parallel_state`` module.

A module ``ps`` with Megatron-Core's ``parallel_state`` API (MCore itself, or
``compat.parallel_state``) is observed through a *snapshot*: a flat ``dict`` from a key (a
getter call with its arguments, a module global, ...) to a plain, comparable value. Two
snapshots taken in the same situation (same fake-backend world, same rank, same
``initialize_model_parallel`` arguments) can be compared with :func:`compare`.

The list of getters, setters and globals is derived from the *reference* module — the
``megatron.core.parallel_state`` importable in this process: the installed Megatron-Core, or,
inside a process bound to another release by ``tests.support.mcore_releases.activate``, that release
— never from the module under test. A getter the reference has and the tested module lacks
shows up as a ``("missing",)`` value, and a getter added to a newer Megatron-Core that this
library does not know how to call raises :class:`UnknownApiError`. Nothing here is written per
release: parameter values are keyed by parameter name, the functions to call come from the
reference's own namespace, pristine globals from the reference at import time.

Value encoding (see :func:`encode`):

* ``None``, ``bool``, ``int``, ``str``, ``float`` stay as they are (an int subclass such as
  ``numpy.int64`` becomes ``(type name, int)``);
* a ``ProcessGroup`` becomes ``("group", ranks)``; its metadata goes to extra keys
  ``meta:<key>`` (``group_desc``, the ``timeout`` / ``backend`` / ``pg_options`` it was
  created with) and ``alias:<key>`` (the first key holding the very same object, so shared
  communicators are visible);
* lists / tuples / dicts keep their type: ``("list", items)``, ``("tuple", items)``,
  ``("dict", sorted items)``; a group inside one gets its metadata keys under its index
  (``meta:<key>[1]``): 0.12/0.13's list of pipeline groups of an encoder rank and its rank
  lists compare by membership, order, description, timeout and backend of every element;
* anything else becomes ``("object", type name)``;
* a call that raises becomes ``("raises", type name, names of the type's MRO)``; compat may
  raise a subclass of MCore's exception type (code that catches MCore's still catches it), or
  of the builtin base of a third-party one (:data:`THIRD_PARTY_ERRORS`).

Besides getters and globals, an observation of ``initialize_model_parallel`` records the
warning categories init emits (0.13: ``DeprecationWarning`` for encoder sizes), environment
changes, barriers and the setter phase.

The library is three modules, re-exported here as one namespace (``from tests.support import
differential as D``): :mod:`tests.support.diff_api` (the reference's functions, globals and
getter calls), :mod:`tests.support.diff_snapshot` (group recording, encoding, snapshots,
comparison) and :mod:`tests.support.diff_observe` (one full ``initialize_model_parallel`` run).
"""

from __future__ import annotations

from tests.support.diff_api import (
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
from tests.support.diff_observe import (
    BUFFER_FUNCTIONS,
    Observation,
    _after_init_phase,
    _capture_pristine,
    _setter_phase,
    destroy_differences,
    env_diff,
    fake_world,
    globals_after_destroy,
    observe,
    preserved_environment,
    pristine_globals,
    reset_mcore,
)
from tests.support.diff_snapshot import (
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
