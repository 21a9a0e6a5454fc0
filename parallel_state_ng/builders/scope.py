"""Scopes in which Megatron's global parallel state refuses to answer.

Inside :func:`no_globals` (or ``MegatronGroups.scope()``) compat's served grid functions raise
:class:`GlobalStateRefusedError` and the initialization probes answer "not initialized";
:func:`allow_globals` re-opens them, the innermost scope wins. One stack per process; a served
getter pays one truth test of :data:`REFUSING`; no torch or megatron import. See docs/compat.md
("Scoping").
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

__all__ = [
    "GlobalStateRefusedError",
    "Scope",
    "REFUSING",
    "no_globals",
    "allow_globals",
    "refusing_scope",
    "refuse",
]


class GlobalStateRefusedError(RuntimeError):
    """A Megatron global getter was called inside a :func:`no_globals` scope.

    Deliberately not an ``AssertionError`` (what an uninitialized getter raises), so code that
    treats "not initialized" as a reason to fall back cannot swallow it.
    """


@dataclass(frozen=True)
class Scope:
    """One entered scope: ``refuses`` the globals or re-allows them, for ``owner``, entered at ``where``."""

    refuses: bool
    owner: str
    where: str


# Every entered scope, innermost last.
_STACK: list[Scope] = []
#: ``[innermost scope]`` while that scope refuses the globals, else empty (the served getters'
#: fast check: ``if REFUSING: ...``).
REFUSING: list[Scope] = []


def _caller(depth: int) -> str:
    """``file:line`` of the frame ``depth`` levels above the caller of this module's public function."""
    frame = sys._getframe(2 + depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _describe(owner: object) -> str:
    if owner is None:
        return "no_globals()"
    if isinstance(owner, str):
        if not owner:
            raise ValueError("owner must be a non-empty description of the scope, got ''")
        return owner
    return repr(owner)


def _sync() -> None:
    REFUSING[:] = _STACK[-1:] if _STACK and _STACK[-1].refuses else []


@contextmanager
def _entered(scope: Scope) -> Iterator[Scope]:
    _STACK.append(scope)
    _sync()
    try:
        yield scope
    finally:
        # Leave exactly this scope even if an inner one was left out of order (a generator
        # that was never closed): everything entered after it goes with it.
        for i in range(len(_STACK) - 1, -1, -1):
            if _STACK[i] is scope:
                del _STACK[i:]
                break
        _sync()


def no_globals(owner: object = None, *, frames_up: int = 0) -> AbstractContextManager[Scope]:
    """A ``with`` block in which Megatron's global parallel state refuses to answer.

    Inside it, every function ``compat.parallel_state`` serves that reads or writes a grid
    (getters, ``set_*``, ``initialize_model_parallel``, ``destroy_model_parallel``, ...) raises
    :class:`GlobalStateRefusedError` naming the function, ``owner`` and where the scope was
    entered; ``model_parallel_is_initialized()`` / ``is_initialized()`` answer ``False``
    (``is_unitialized()`` ``True``); functions that touch no grid (the global memory buffer,
    ``RankGenerator``, pure rank helpers) work as before. With ``compat.install()`` this covers
    Megatron's own modules; Megatron's original ``parallel_state`` (compat not installed) is
    not guarded.

    ``owner`` names the scope in errors (a string, or an object whose ``repr`` is used, e.g. a
    ``MegatronGroups``). Scopes nest (the innermost decides; ``compat.parallel_state.use_state``
    re-allows a grid inside), and leaving one, normally or by an exception, restores the
    enclosing one. Outside every scope nothing changes.

    ``frames_up`` (for wrappers such as ``MegatronGroups.scope``): how many frames above the
    direct caller the scope is reported as entered.

    Raises:
        ValueError: ``owner`` is an empty string.
    """
    return _entered(Scope(refuses=True, owner=_describe(owner), where=_caller(frames_up)))


def allow_globals(owner: object, *, frames_up: int = 0) -> AbstractContextManager[Scope]:
    """A ``with`` block in which the global getters answer again, inside an enclosing :func:`no_globals`.

    ``compat.parallel_state.use_state(state)`` enters one for ``state``; outside any refusing
    scope it changes nothing.
    """
    return _entered(Scope(refuses=False, owner=_describe(owner), where=_caller(frames_up)))


def refusing_scope() -> Scope | None:
    """The innermost scope if it refuses the globals, else ``None``."""
    return REFUSING[0] if REFUSING else None


def refuse(function: str) -> None:
    """Raise :class:`GlobalStateRefusedError` for ``function`` if the innermost scope refuses the globals."""
    if not REFUSING:
        return
    scope = REFUSING[0]
    raise GlobalStateRefusedError(
        f"parallel_state.{function}() was called inside a no-globals scope ({scope.owner}, entered at "
        f"{scope.where}): code in this scope must take its process groups from its ProcessGroupCollection "
        f"(pg_collection=...), and the module globals belong to another grid. Pass the groups explicitly, "
        f"or run the legacy code inside compat.parallel_state.use_state(<its state>)."
    )
