"""``HyperCommGrid`` classes with exactly one megatron-core release's surface.

:func:`hyper_comm_grid_class` returns a subclass of
:class:`parallel_state_ng.builders.grid.HyperCommGrid` whose Megatron methods are exactly the
release's (absent ones absent, signatures equal) and whose behaviour and extra methods are
ours, built from :mod:`parallel_state_ng.releases.hyper_comm_grid` (one cached class per
series). ``compat.install(hyper_comm_grid=True)`` puts it in Megatron's place. See docs/engine.md.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from parallel_state_ng.builders.grid import HyperCommGrid
from parallel_state_ng.releases import (
    SUPPORTED_SERIES,
    Release,
    UnsupportedReleaseError,
    current_release,
    parse_release,
    select_release,
)
from parallel_state_ng.releases import hyper_comm_grid as _facts

__all__ = ["hyper_comm_grid_class"]


class _Absent:
    """A class attribute that is not there: reading it raises ``AttributeError``."""

    def __init__(self, name: str, series: str, since: str) -> None:
        self.name, self.series, self.since = name, series, since

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        raise AttributeError(
            f"HyperCommGrid of megatron-core {self.series} has no attribute {self.name!r} "
            f"(megatron-core {self.since} added it); parallel_state_ng.HyperCommGrid has every release's methods"
        )


def _forwarder(name: str, sig: inspect.Signature, series: str) -> Callable[..., Any]:
    """A method with signature ``sig`` that calls our grid's method ``name``."""
    engine = getattr(HyperCommGrid, name)
    varkw = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    takes_view = "view" in sig.parameters

    def method(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{name}(): {error}") from None
        arguments = dict(bound.arguments)
        del arguments["self"]
        extra = arguments.pop(varkw, {}) if varkw else {}
        if "view" in extra and not takes_view:
            raise TypeError(
                f"{name}() got an unexpected keyword argument 'view': views came with megatron-core "
                f"{_facts.VIEW_SINCE}, this HyperCommGrid serves {series}"
            )
        return engine(self, **arguments, **extra)

    method.__name__ = name
    method.__qualname__ = f"HyperCommGrid.{name}"
    method.__doc__ = engine.__doc__
    method.__signature__ = sig  # type: ignore[attr-defined]
    return method


def _first_series(name: str) -> str:
    return min(_facts.METHODS[name], key=lambda series: parse_release(series).key)


@functools.cache
def _build(series: str) -> type:
    present = _facts.methods(series)
    namespace: dict[str, Any] = {
        "__module__": __name__,
        "__qualname__": "HyperCommGrid",
        "__doc__": (
            f"``megatron.core.hyper_comm_grid.HyperCommGrid`` of megatron-core {series}, on "
            f":class:`parallel_state_ng.builders.grid.HyperCommGrid` "
            "(see :mod:`parallel_state_ng.builders.grid_releases`)."
        ),
        "megatron_release": series,
    }
    absent = []
    for name in _facts.all_method_names():
        if name in present:
            namespace[name] = _forwarder(name, _facts.signature(present[name]), series)
        else:
            namespace[name] = _Absent(name, series, _first_series(name))
            absent.append(name)
    hidden = frozenset(absent)

    def __dir__(self: Any) -> list[str]:
        return [n for n in object.__dir__(self) if n not in hidden]

    namespace["__dir__"] = __dir__
    return type("HyperCommGrid", (HyperCommGrid,), namespace)


def hyper_comm_grid_class(release: Release | str | None = None) -> type:
    """The ``HyperCommGrid`` class serving ``release``'s surface (default: the current release).

    ``release`` is a :class:`~parallel_state_ng.releases.Release`, a version string (``"0.16"``,
    ``"0.19.2"``) or ``None`` for :func:`~parallel_state_ng.releases.current_release`. Releases of
    one series share a class; the class is a subclass of :class:`parallel_state_ng.builders.grid.HyperCommGrid`
    and its ``megatron_release`` attribute names the series.

    Raises:
        parallel_state_ng.releases.UnsupportedReleaseError: ``release`` is not supported or has
            no ``HyperCommGrid`` (older than 0.14).
    """
    if release is None:
        rel = current_release()
    elif isinstance(release, Release) and release.series in SUPPORTED_SERIES:
        rel = release
    else:
        rel = select_release(str(release))  # validates: too old raises, too new warns
    if not _facts.has_class(rel):
        raise UnsupportedReleaseError(
            f"megatron-core {rel} has no HyperCommGrid (it came with {_facts.CLASS_SINCE}); "
            f"use parallel_state_ng.HyperCommGrid directly"
        )
    return _build(rel.series)
