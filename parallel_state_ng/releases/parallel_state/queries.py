"""Queries of the per-release ``megatron.core.parallel_state`` surface (:mod:`.surface`).

:func:`functions`, :func:`signature`, :func:`globals_of`, :func:`rank_generator_methods`,
:func:`has` and :func:`positional_changes` answer for one release (or a pair) from
:data:`~.surface.FUNCTIONS`, :data:`~.surface.GLOBALS` and :data:`~.surface.RANK_GENERATOR`.
"""

from __future__ import annotations

import functools

from parallel_state_ng.releases import Release, known_release
from parallel_state_ng.releases.parallel_state.legacy import GLOBAL_VALUE_EXCEPTIONS
from parallel_state_ng.releases.parallel_state.signatures import Param, Variant
from parallel_state_ng.releases.parallel_state.surface import FUNCTIONS, GLOBALS, RANK_GENERATOR

__all__ = ["functions", "signature", "globals_of", "rank_generator_methods", "has", "positional_changes"]


def _pick(variants: list[Variant], release: Release) -> Variant | None:
    for variant in variants:
        if variant.covers(release):
            return variant
    return None


def signature(name: str, release: str | Release) -> tuple[Param, ...] | None:
    """The parameters of function ``name`` in ``release``, or ``None`` if it has no such function.

    Raises:
        KeyError: no supported release has ``name``.
    """
    variant = _pick(FUNCTIONS[name], known_release(release))
    return None if variant is None else variant.params


def _present(table: dict[str, list[Variant]], release: str | Release) -> dict[str, tuple[Param, ...]]:
    """Each name of ``table`` that ``release`` has, with that release's parameters, in table order."""
    r = known_release(release)
    picked = ((name, _pick(variants, r)) for name, variants in table.items())
    return {name: variant.params for name, variant in picked if variant is not None}


def functions(release: str | Release) -> dict[str, tuple[Param, ...]]:
    """Every public function of ``release`` with its parameters, in MCore's module order."""
    return _present(FUNCTIONS, release)


def globals_of(release: str | Release) -> dict[str, type | None]:
    """Every module global of ``release`` -> its import-time value (``None``, or ``dict``: empty dict)."""
    return dict(_globals_of_series(known_release(release).series))


@functools.cache
def _globals_of_series(series: str) -> tuple[tuple[str, type | None], ...]:
    # Cached: compat publishes the globals on every init and destroy (about 130 release
    # comparisons each time otherwise).
    r = known_release(series)
    return tuple(
        (name, GLOBAL_VALUE_EXCEPTIONS.get(name, {}).get(r.series, init))
        for name, (since, until, init) in GLOBALS.items()
        if Variant(since, until, ()).covers(r)
    )


def rank_generator_methods(release: str | Release) -> dict[str, tuple[Param, ...]]:
    """``RankGenerator``'s methods in ``release`` with their parameters (``self`` left out)."""
    return _present(RANK_GENERATOR, release)


def has(name: str, release: str | Release) -> bool:
    """Whether ``release``'s API has a function or a function's parameter.

    ``name`` is a function name (``"create_all_gather_groups"``) or ``"function.parameter"``
    (``"initialize_model_parallel.rank_offset"``). Behaviour that changed without a signature
    change is in :mod:`parallel_state_ng.releases.facts`.
    """
    r = known_release(release)
    fact = name
    if fact in FUNCTIONS:
        return signature(fact, r) is not None
    function, _, parameter = fact.partition(".")
    if parameter and function in FUNCTIONS:
        params = signature(function, r)
        return params is not None and parameter in dict(params)
    raise KeyError(f"unknown name {fact!r}: not a function or 'function.parameter' of any known release")


def positional_changes(name: str, old: str | Release, new: str | Release) -> list[tuple[int, str | None, str | None]]:
    """Positions whose parameter differs between ``old`` and ``new`` for function ``name``.

    Returns ``(index, old parameter, new parameter)`` for every position where a positional
    argument would change meaning (``None``: no parameter at that position in that release).
    An empty list means positional calls keep their meaning.

    Raises:
        ValueError: one of the releases has no function ``name``.
    """
    before, after = signature(name, old), signature(name, new)
    if before is None or after is None:
        missing = old if before is None else new
        raise ValueError(f"{name} does not exist in megatron-core {missing}")
    a, b = [n for n, _ in before], [n for n, _ in after]
    return [
        (i, a[i] if i < len(a) else None, b[i] if i < len(b) else None)
        for i in range(max(len(a), len(b)))
        if (a[i] if i < len(a) else None) != (b[i] if i < len(b) else None)
        and i < len(a)  # positions only the new release has cannot be passed by old callers
    ]
