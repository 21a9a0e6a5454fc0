"""Per-release facts about ``megatron.core.parallel_state``: its API surface and behaviour (data).

Read from each release's ``parallel_state.py`` (0.12.3 … 0.19.2). The rooms: :mod:`.signatures`
(how a signature is written: :data:`REQUIRED`, :data:`Param`, :class:`Variant`),
:mod:`.surface` (the tables :data:`FUNCTIONS`, :data:`GLOBALS`, :data:`RANK_GENERATOR`),
:mod:`.legacy` (what 0.12/0.13 differ in, merged into the tables at import),
:mod:`.replacements` (:data:`REPLACEMENTS`: what replaced removed names) and :mod:`.queries`
(:func:`functions`, :func:`signature`, :func:`globals_of`, :func:`rank_generator_methods`,
:func:`has`, :func:`positional_changes`). Every public name is importable from here. See
docs/releases.md.
"""

from __future__ import annotations

from parallel_state_ng.releases.parallel_state.legacy import GLOBAL_VALUE_EXCEPTIONS
from parallel_state_ng.releases.parallel_state.queries import (
    functions,
    globals_of,
    has,
    positional_changes,
    rank_generator_methods,
    signature,
)
from parallel_state_ng.releases.parallel_state.replacements import REPLACEMENTS, replacement
from parallel_state_ng.releases.parallel_state.signatures import REQUIRED, Param, Variant
from parallel_state_ng.releases.parallel_state.surface import FUNCTIONS, GLOBALS, RANK_GENERATOR

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
