"""Megatron-Core compatibility layer of parallel_state_ng.

``compat.parallel_state`` serves the whole global API of ``megatron.core.parallel_state`` of one
release on the engine; :func:`install` / :func:`uninstall` make Megatron itself use it;
:func:`no_globals` is the engine's :func:`parallel_state_ng.no_globals`; :func:`use_collection`
serves a ``ProcessGroupCollection`` as the globals for a ``with`` block; ``python -m compat.run
SCRIPT`` (:mod:`compat.run`) installs and runs an unchanged program. Importing this package
imports neither megatron nor torch. See docs/compat.md.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

__all__ = ["install", "uninstall", "is_installed", "no_globals", "use_collection", "verify_groups"]


def install(hyper_comm_grid: bool = False) -> None:
    """Make ``megatron.core.parallel_state`` resolve to ``compat.parallel_state``.

    Works whether megatron was imported before or after: ``sys.modules`` and the
    ``megatron.core.parallel_state`` / ``megatron.core.mpu`` attributes point at compat, and
    names already bound in loaded modules (``from megatron.core.parallel_state import
    get_tensor_model_parallel_rank`` in ``tensor_parallel/layers.py`` and many others, or
    ``from megatron.core import parallel_state as mpu``) are rebound to compat's objects.
    Works for every supported release (``compat.parallel_state`` serves the installed one's API).

    With ``hyper_comm_grid=True`` also ``megatron.core.hyper_comm_grid.HyperCommGrid`` and every
    name bound to it by ``from megatron.core.hyper_comm_grid import HyperCommGrid`` become
    :class:`parallel_state_ng.builders.grid.HyperCommGrid`, so Megatron's multi-module code (bridge and
    multimodule communicators, MIMO) runs on our grid (megatron's grid module is imported for
    this if it is not loaded yet).

    With or without it, on 0.19 (the release with ``megatron.core.inference.shards``)
    ``build_inference_pg_collection`` and ``build_inference_pg_collections_for_shards`` become
    :mod:`parallel_state_ng.builders.inference`'s, now or when that module is first imported.
    Calling it twice is harmless (a second call may add ``hyper_comm_grid=True``).
    :func:`uninstall` undoes everything.

    Raises:
        parallel_state_ng.releases.UnsupportedReleaseError: ``hyper_comm_grid=True`` while
            serving 0.12 or 0.13, which have no ``HyperCommGrid`` (nothing is installed then).
    """
    from ._install import install as _install

    _install(hyper_comm_grid=hyper_comm_grid)


def uninstall() -> None:
    """Undo :func:`install`: every patched name gets back Megatron's own object."""
    from ._install import uninstall as _uninstall

    _uninstall()


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    import sys

    mod = sys.modules.get("compat._install")
    return bool(mod and mod.is_installed())


def no_globals(owner: object = None) -> AbstractContextManager[Any]:
    """A ``with`` block in which ``compat.parallel_state``'s global getters raise instead of answering.

    The engine's :func:`parallel_state_ng.builders.scope.no_globals` (see there): for code that
    takes its groups from a ``ProcessGroupCollection`` while the module globals hold another
    grid. ``owner`` names the scope in the errors.

    Raises:
        ValueError: ``owner`` is an empty string.
    """
    from parallel_state_ng.builders.scope import no_globals as _no_globals

    return _no_globals(owner, frames_up=1)


def verify_groups(**config: Any) -> Any:
    """Check compat's current groups against the layout MCore builds for ``config``; collective.

    :func:`parallel_state_ng.builders.verify.verify_groups` over ``compat.parallel_state`` (the
    active grid's globals) for the served release; ``config`` takes the same arguments
    (``tensor_model_parallel_size=2, raise_as=AssertionError, ...``). Returns its report.
    """
    from parallel_state_ng.builders.verify import verify_groups as _verify_groups

    from . import parallel_state

    config.setdefault("release", parallel_state.MEGATRON_RELEASE)
    return _verify_groups(parallel_state, **config)


def use_collection(pgc: Any) -> AbstractContextManager[Any]:
    """A ``with`` block in which ``compat.parallel_state``'s globals are the groups of ``pgc``.

    :func:`compat._collection.use_collection` (see there): the layout is inferred from the
    groups' members and checked, the ranks agree on it, a getter of a missing field raises,
    and the previous state is restored on exit. Imports torch (not megatron) when called.
    """
    from ._collection import use_collection as _use_collection

    return _use_collection(pgc)
