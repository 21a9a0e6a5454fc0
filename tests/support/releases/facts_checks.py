"""The per-release data (``parallel_state_ng.releases.parallel_state``) against one release's module.

:func:`facts_report` runs inside a process bound to one megatron-core release
(``tests.support.releases.wheels.run_in_release``) and compares what the data says about it with
the imported ``megatron.core.parallel_state``, both directions. It covers the releases the data
knows but compat does not serve (0.12, 0.13), for the upgrade check; the supported ones are
checked through compat (:mod:`tests.support.releases.compat_checks`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD.name


def _shape(fn: Callable) -> list[list[str]]:
    return [
        [p.name, p.kind.name, "<none>" if p.default is inspect.Parameter.empty else repr(p.default)]
        for p in inspect.signature(fn).parameters.values()
    ]


def _data_shape(params: tuple) -> list[list[str]]:
    from parallel_state_ng.releases.parallel_state import REQUIRED

    return [[name, _POSITIONAL, "<none>" if default is REQUIRED else repr(default)] for name, default in params]


def _value_matches(expected: Any, actual: Any) -> bool:
    return actual is None if expected is None else type(actual) is expected and actual == expected()


def facts_report(version: str) -> dict:
    """Data vs the imported release: counts and problems (empty when they agree).

    Public functions with their parameters (names, kinds, defaults) in module order, state
    globals with their import-time values, ``RankGenerator``'s methods.
    """
    import megatron.core.parallel_state as ref

    from parallel_state_ng.releases import parallel_state as data

    problems: list[str] = []
    theirs = {
        n: o
        for n, o in vars(ref).items()
        if inspect.isfunction(o) and o.__module__ == ref.__name__ and not n.startswith("_")
    }
    ours = data.functions(version)
    for name, fn in theirs.items():
        if name not in ours:
            problems.append(f"data lacks function {name}{inspect.signature(fn)}")
        elif _shape(fn) != _data_shape(ours[name]):
            problems.append(f"{name}: release {inspect.signature(fn)} != data {ours[name]}")
    problems += [f"data has function {n}, which {version} lacks" for n in ours if n not in theirs]
    common = [n for n in theirs if n in ours]
    if common != [n for n in ours if n in theirs]:
        problems.append("functions are not in the release's module order")

    state = {
        n: o
        for n, o in vars(ref).items()
        if n.startswith("_")
        and not n.startswith("__")
        and not inspect.isroutine(o)
        and not inspect.isclass(o)
        and not inspect.ismodule(o)
        and type(o).__module__ != "typing"
    }
    values = data.globals_of(version)
    for name, value in state.items():
        if name not in values:
            problems.append(f"data lacks global {name}")
        elif not _value_matches(values[name], value):
            problems.append(f"global {name}: release value {value!r}, data {values[name]}")
    problems += [f"data has global {n}, which {version} lacks" for n in values if n not in state]

    methods = {
        n: o
        for n, o in vars(ref.RankGenerator).items()
        if inspect.isfunction(o) and (not n.startswith("_") or n == "__init__")
    }
    rg = data.rank_generator_methods(version)
    for name, fn in methods.items():
        if name not in rg:
            problems.append(f"data lacks RankGenerator.{name}")
        elif _shape(fn)[1:] != _data_shape(rg[name]):
            problems.append(f"RankGenerator.{name}: release {inspect.signature(fn)} != data {rg[name]}")
    problems += [f"data has RankGenerator.{n}, which {version} lacks" for n in rg if n not in methods]
    return {
        "functions": len(theirs),
        "globals": len(state),
        "rank_generator_methods": len(methods),
        "problems": problems,
    }
