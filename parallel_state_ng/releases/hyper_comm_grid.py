"""Per-release facts about ``megatron.core.hyper_comm_grid.HyperCommGrid`` (data only).

Read from each release's ``megatron/core/hyper_comm_grid.py`` (0.12/0.13 have none).
:data:`METHODS` gives, per method, the signature each release introduced (a later entry replaces
an earlier one; ``None`` would mark a removal); :func:`methods` answers for one release. An
unknown dim raises a different type per release and call:
:class:`parallel_state_ng.layout.named_layout.UnknownDimError` is all of them. See docs/engine.md.
"""

from __future__ import annotations

import inspect
from typing import Any

from parallel_state_ng.releases import SUPPORTED_SERIES, Release, as_release, parse_release

__all__ = [
    "METHODS",
    "ATTRIBUTES",
    "CLASS_SINCE",
    "VIEW_SINCE",
    "has_class",
    "methods",
    "method_names",
    "all_method_names",
    "signature",
    "differences",
]

_EMPTY = inspect.Parameter.empty
_POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KW = inspect.Parameter.KEYWORD_ONLY
_VARKW = inspect.Parameter.VAR_KEYWORD

# A parameter: (name, kind, default); kind "p" positional-or-keyword, "k" keyword-only,
# "**" var-keyword. Defaults are plain values.
Param = tuple[str, str, Any]


def _p(name: str, default: Any = _EMPTY) -> Param:
    return (name, "p", default)


def _k(name: str, default: Any = _EMPTY) -> Param:
    return (name, "k", default)


def _varkw(name: str) -> Param:
    return (name, "**", _EMPTY)


# method -> {series it (re)appeared with: its parameters after ``self`` (None: removed)}
METHODS: dict[str, dict[str, tuple[Param, ...] | None]] = {
    "__init__": {"0.14": (_p("shape"), _p("dim_names"), _p("rank_offset", 0), _p("backend", None))},
    "create_pg": {"0.14": (_p("dims"), _varkw("kwargs")), "0.19": (_p("dims"), _k("view", None), _varkw("kwargs"))},
    "get_pg": {"0.14": (_p("dims"),), "0.19": (_p("dims"), _k("view", None))},
    "get_rank_enum": {"0.16": (_p("dims"),), "0.19": (_p("dims"), _k("view", None))},
    "destroy": {"0.17": ()},
    "is_current_rank_in_grid": {"0.17": ()},
    "register_view": {"0.19": (_p("name"), _p("shape"), _p("dim_names"), _p("shared_dims", None))},
    # private, but called by Megatron's bridge_communicator / multimodule_communicator
    "_gen_rank_enum": {"0.14": (_p("dims"),)},
}

# Instance attributes every release sets (and Megatron's code reads).
ATTRIBUTES: tuple[str, ...] = ("shape", "dim_names", "rank_offset", "size", "backend")

# The first release with ``megatron/core/hyper_comm_grid.py`` (0.12 and 0.13 have none).
CLASS_SINCE = "0.14"

# The release that introduced views (``register_view``, ``view=``).
VIEW_SINCE = "0.19"

_KINDS = {"p": _POS, "k": _KW, "**": _VARKW}
ReleaseArg = Release | str | None


def _params(name: str, release: Release) -> tuple[Param, ...] | None:
    found: tuple[Param, ...] | None = None
    for series, params in sorted(METHODS[name].items(), key=lambda item: parse_release(item[0]).key):
        if release.at_least(series):
            found = params
    return found


def has_class(release: ReleaseArg = None) -> bool:
    """Whether ``release`` (default: the current one) has ``megatron.core.hyper_comm_grid.HyperCommGrid``."""
    return as_release(release).at_least(CLASS_SINCE)


def signature(params: tuple[Param, ...]) -> inspect.Signature:
    """The ``inspect.Signature`` (with ``self`` first) of a :data:`METHODS` parameter tuple."""
    out = [inspect.Parameter("self", _POS)]
    out += [inspect.Parameter(name, _KINDS[kind], default=default) for name, kind, default in params]
    return inspect.Signature(out)


def methods(release: ReleaseArg = None) -> dict[str, tuple[Param, ...]]:
    """The methods ``HyperCommGrid`` has in ``release`` (default: the current one) and their parameters."""
    rel = as_release(release)
    out = {}
    for name in METHODS:
        params = _params(name, rel)
        if params is not None:
            out[name] = params
    return out


def method_names(release: ReleaseArg = None) -> list[str]:
    """Names of the methods ``HyperCommGrid`` has in ``release``, in :data:`METHODS` order."""
    return list(methods(release))


def all_method_names() -> list[str]:
    """Every method name any supported release has."""
    return [name for name in METHODS if any(name in methods(series) for series in SUPPORTED_SERIES)]


def differences(
    old: ReleaseArg, new: ReleaseArg
) -> dict[str, tuple[inspect.Signature | None, inspect.Signature | None]]:
    """Methods added, removed or changed from ``old`` to ``new``: name -> (old signature, new signature).

    ``None`` on one side: the method does not exist in that release.
    """
    before, after = methods(old), methods(new)
    out = {}
    for name in METHODS:
        a, b = before.get(name), after.get(name)
        if a != b:
            out[name] = (None if a is None else signature(a), None if b is None else signature(b))
    return out
