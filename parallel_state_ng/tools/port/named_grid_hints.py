"""The named-grid equivalent the ``port`` report shows beside a use of parallel_state.

A getter such as ``get_data_parallel_group(with_context_parallel=True)`` or a published module
global such as ``_TENSOR_MODEL_PARALLEL_GROUP`` stands for one group kind of the named grid
(``compat.parallel_state.get_state().groups["dp_cp"]``). :func:`getter_hint` reads the
arguments of a getter call that select the kind (when they are constants), :func:`global_hint`
covers the globals; the spellings come from :func:`.table.named_grid_equivalent`. The tool:
docs/tools.md#port-tool.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any, cast

from parallel_state_ng.tools.port.table import (
    GETTER_VARIANTS,
    NAMED_GRID_GETTERS,
    _published_globals,
    named_grid_equivalent,
)

__all__ = ["getter_hint", "global_hint"]


class _Dynamic:
    """An argument whose value the scanner cannot know."""


def _call_flags(name: str, call: ast.Call | None, keywords: set[str]) -> dict[str, bool | None] | None:
    """Values (True/False, None if unknown) of ``keywords`` in ``call`` of compat's ``name``."""
    if call is None:
        return None
    import compat.parallel_state as ps

    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None

    def value(node: ast.expr) -> Any:
        return node.value if isinstance(node, ast.Constant) else _Dynamic()

    try:
        bound = inspect.signature(getattr(ps, name)).bind_partial(
            # no keyword is **kwargs (k.arg None): checked above
            *[value(a) for a in call.args],
            **{cast(str, k.arg): value(k.value) for k in call.keywords},
        )
    except (TypeError, ValueError, AttributeError):
        return None
    flags: dict[str, bool | None] = {}
    for kw in keywords:
        if kw not in bound.arguments:
            flags[kw] = False
        else:
            v = bound.arguments[kw]
            flags[kw] = None if isinstance(v, _Dynamic) else bool(v)
    return flags


def getter_hint(name: str, call: ast.Call | None) -> str | None:
    """The named-grid hint of a call of getter ``name`` (or of a reference to it: ``call``
    None); None when ``name`` is not a group/rank/size getter.

    When the group kind depends on flag arguments (``with_context_parallel=...``) whose values
    the call does not spell as constants, the hint lists the alternatives.
    """
    if name not in NAMED_GRID_GETTERS:
        return None
    kind, accessor = NAMED_GRID_GETTERS[name]
    variants = GETTER_VARIANTS.get(name, ())
    if not variants:
        return named_grid_equivalent(kind, accessor)
    flags = _call_flags(name, call, {k for kws, _ in variants for k in kws})
    if flags is not None and all(v is not None for v in flags.values()):
        for kws, variant_kind in variants:
            if all(flags[k] for k in kws):
                return named_grid_equivalent(variant_kind, accessor)
        return named_grid_equivalent(kind, accessor)
    alternatives = [("=True and ".join(kws) + "=True", variant_kind) for kws, variant_kind in variants]
    return named_grid_equivalent(kind, accessor, alternatives)


def global_hint(name: str) -> str | None:
    """The named-grid hint of module global ``name`` when compat publishes a group or a rank
    list under it; else None.
    """
    if name in _published_globals():
        kind, accessor = _published_globals()[name]
        return named_grid_equivalent(kind, accessor)
    return None
