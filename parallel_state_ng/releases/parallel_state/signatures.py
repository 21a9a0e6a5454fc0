"""The vocabulary :mod:`.surface`'s tables are written in: parameters and signature variants.

A parameter is ``(name, default)``, ``default`` being :data:`REQUIRED` for a required one
(:data:`Param`); a :class:`Variant` is one signature of a function, valid for a range of release
series (:func:`variant` writes one). :func:`params`, :func:`insert_params` and
:func:`drop_param` build parameter tuples; :func:`series_after` names the series that follows
one. Data only, no release facts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallel_state_ng.releases import Release, as_release

__all__ = ["REQUIRED", "Param", "Variant", "params", "variant", "series_after", "insert_params", "drop_param"]


class _Required:
    """Marker for a parameter without default."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
#: ``(name, default)``; ``default`` is :data:`REQUIRED` for a required parameter.
Param = tuple[str, Any]


def params(*spec: str | tuple[str, Any]) -> tuple[Param, ...]:
    """Parameters from ``spec``: a bare name is a required parameter, ``(name, default)`` one with a default."""
    return tuple((p, REQUIRED) if isinstance(p, str) else (p[0], p[1]) for p in spec)


@dataclass(frozen=True)
class Variant:
    """One signature of a function, valid for release series ``since`` … ``until`` (inclusive)."""

    since: str
    until: str
    params: tuple[Param, ...]

    def covers(self, release: str | Release) -> bool:
        """Whether ``release`` (``"0.17"``, ``"0.17.1"`` or a :class:`Release`) has this variant."""
        r = as_release(release)
        return r.at_least(self.since) and not r.at_least(series_after(self.until))

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names, in order."""
        return tuple(name for name, _ in self.params)


def variant(since: str, until: str, *spec: str | tuple[str, Any]) -> Variant:
    """The :class:`Variant` valid from ``since`` to ``until`` with the parameters of ``spec`` (see :func:`params`)."""
    return Variant(since, until, params(*spec))


def series_after(series: str) -> str:
    """The release series that follows ``series`` (``"0.17"`` -> ``"0.18"``)."""
    major, minor = (int(x) for x in series.split("."))
    return f"{major}.{minor + 1}"


def insert_params(params: tuple[Param, ...], after: str, *new: Param) -> tuple[Param, ...]:
    """``params`` with ``new`` inserted right after the parameter named ``after``."""
    names = [n for n, _ in params]
    i = names.index(after) + 1
    return params[:i] + tuple(new) + params[i:]


def drop_param(params: tuple[Param, ...], name: str) -> tuple[Param, ...]:
    """``params`` without the parameter named ``name``."""
    return tuple(p for p in params if p[0] != name)
