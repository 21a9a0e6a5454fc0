"""The active grid of ``compat.parallel_state``: get, scope, detach, destroy (not MCore API,
apart from ``destroy_model_parallel``).

A job may hold several independent grids (e.g. a vision encoder with tp 2 and a language
model with tp 4 over the same ranks). Build each with ``initialize_model_parallel`` and
:func:`detach_state`, then activate one at a time with :func:`use_state`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from parallel_state_ng.builders.scope import allow_globals
from parallel_state_ng.groups.abort import AbortResult, abort_groups
from parallel_state_ng.groups.megatron_groups import ModelParallelGroups, destroy_model_groups

from ._namespace import facade as ps
from ._publish import BLOCK_OVERRIDES, BUFFER_GLOBALS, OVERRIDE_GLOBALS, STATE_EXTRAS, publish, state_globals
from ._release import FACTS

__all__ = [
    "get_state",
    "set_active",
    "use_state",
    "detach_state",
    "destroy_state",
    "destroy_model_parallel",
    "abort_model_parallel",
]

# The state object the globals mirror (None when not initialized).
_ACTIVE: list[ModelParallelGroups | None] = [None]
# id(detached state) -> (state, its STATE_EXTRAS values); holding the state keeps its id unique.
_DETACHED: dict[int, tuple[ModelParallelGroups, dict[str, Any]]] = {}
# The states that enclosing use_state blocks make active again on exit, outermost first.
_SUSPENDED: list[ModelParallelGroups | None] = []


def _ns() -> dict[str, Any]:
    return ps.namespace


def get_state() -> ModelParallelGroups | None:
    """The state object behind the globals (``None`` before initialization).

    Not part of MCore's API: it gives new code the layout (``get_state().layout``) and every
    group by kind (``get_state().groups``).
    """
    return _ACTIVE[0]


def set_active(state: ModelParallelGroups | None) -> None:
    """Make ``state`` the active grid and publish it into the module globals."""
    _ACTIVE[0] = state
    publish(_ns(), state)


def _extras_of(state: ModelParallelGroups | None) -> dict[str, Any]:
    """The STATE_EXTRAS values that go with ``state`` when it becomes active."""
    ns = _ns()
    names = [n for n in STATE_EXTRAS if n in ns]
    if state is None:
        return dict.fromkeys(names)
    if state is _ACTIVE[0]:
        return {name: ns[name] for name in names}
    if id(state) in _DETACHED:
        return dict(_DETACHED[id(state)][1])
    # built elsewhere (e.g. by build_megatron_groups): no virtual pipeline, the buffers in place
    return {name: (ns[name] if name in BUFFER_GLOBALS else None) for name in names}


@contextmanager
def use_state(state: ModelParallelGroups | None) -> Iterator[ModelParallelGroups | None]:
    """Make ``state`` the grid every getter reads inside the ``with`` block.

    ``state`` is a grid from :func:`get_state` or :func:`detach_state` (``None``: no grid, every
    getter fails as uninitialized). Inside the block the module globals mirror ``state`` alone:
    a getter whose group ``state`` lacks (no gloo twin, not an embedding stage, no hierarchical
    context parallelism, ...) raises ``AssertionError`` as MCore does before initialization
    (or returns ``None`` with ``check_initialized=False``) instead of answering for another
    grid. The grid's virtual-pipeline size and global memory buffer come with it.

    ``set_*`` overrides are per block: the block starts without any and those set inside it are
    dropped on exit. On exit, normal or by an exception, the previous grid, its overrides and
    globals are restored exactly; blocks nest. A grid initialized inside a block must be
    detached there, else it is dropped on exit with its groups alive (a ``ResourceWarning``).

    Inside a no-globals scope (``MegatronGroups.scope()``,
    :func:`parallel_state_ng.builders.scope.no_globals`) the block re-opens the globals for
    ``state`` alone, e.g. for a legacy module called from a new-code one; the enclosing scope
    refuses again on exit.
    """
    ns = _ns()
    extras = _extras_of(state)
    saved_state = _ACTIVE[0]
    names = {*state_globals(ns), *BLOCK_OVERRIDES, *STATE_EXTRAS}
    saved = {name: ns[name] for name in names if name in ns}
    _SUSPENDED.append(saved_state)
    try:
        set_active(state)
        ns.update(extras)
        for name in BLOCK_OVERRIDES:
            ns[name] = None
        with allow_globals(f"compat.parallel_state.use_state({_label(state)})", frames_up=2):
            yield state
    finally:
        _SUSPENDED.pop()
        left = _ACTIVE[0]
        _ACTIVE[0] = saved_state
        ns.update(saved)
        if left is not None and left is not state and id(left) not in _DETACHED:
            warnings.warn(
                "a parallel state initialized inside a use_state block was neither detached nor "
                "destroyed there; its process groups stay alive but no getter can reach them",
                ResourceWarning,
                stacklevel=3,
            )


def _label(state: ModelParallelGroups | None) -> str:
    """A short description of ``state`` for scope messages."""
    if state is None:
        return "None"
    lay = state.layout
    return (
        f"grid tp={lay.tensor_model_parallel_size} pp={lay.pipeline_model_parallel_size} "
        f"cp={lay.context_parallel_size} dp={lay.data_parallel_size} ep={lay.expert_model_parallel_size}"
    )


def _clear_module(ns: dict[str, Any]) -> None:
    set_active(None)
    for name in (*OVERRIDE_GLOBALS, *BUFFER_GLOBALS):
        if name in ns:
            ns[name] = None
    if "_MOE_LAYER_WISE_LOGGING_TRACKER" in ns:  # 0.12: destroy starts a new tracker
        ns["_MOE_LAYER_WISE_LOGGING_TRACKER"] = {}


def detach_state() -> ModelParallelGroups:
    """Take the active grid out of the module without destroying its groups; return it.

    The module is left as :func:`destroy_model_parallel` leaves it (uninitialized, overrides
    and buffers cleared), so ``initialize_model_parallel`` can build another grid. The returned
    state keeps its groups, virtual-pipeline size and memory buffer: activate it with
    :func:`use_state`, export it with ``compat.pg_collection.to_process_group_collection``,
    and free it with :func:`destroy_state`. Typical use::

        initialize_model_parallel(tensor_model_parallel_size=2)
        vision = detach_state()
        initialize_model_parallel(tensor_model_parallel_size=4)
        language = detach_state()
        with use_state(vision):
            ...  # Megatron code sees the tp-2 grid
        destroy_state(vision); destroy_state(language)

    Raises:
        AssertionError: no grid is active.
    """
    state = _ACTIVE[0]
    if state is None:
        raise AssertionError(
            "no parallel state to detach: initialize_model_parallel has not run, or its grid was "
            "destroyed or detached already"
        )
    ns = _ns()
    _DETACHED[id(state)] = (state, {name: ns[name] for name in STATE_EXTRAS if name in ns})
    _clear_module(ns)
    return state


def destroy_state(state: ModelParallelGroups) -> None:
    """Destroy the process groups of ``state``, an active or detached grid.

    The active grid is destroyed with :func:`destroy_model_parallel`; a detached one is
    destroyed without touching the active grid. Destroying a grid twice is harmless.

    Raises:
        TypeError: ``state`` is not a ModelParallelGroups.
        AssertionError: an enclosing :func:`use_state` block would make ``state`` active again
            on exit (destroy it after that block).
    """
    if not isinstance(state, ModelParallelGroups):
        raise TypeError(
            f"state must be compat's state, a ModelParallelGroups (from get_state or detach_state), got {state!r}"
        )
    if any(s is state for s in _SUSPENDED):
        raise AssertionError(
            "this parallel state is restored by an enclosing use_state block on exit; destroy it after that block"
        )
    if state is _ACTIVE[0]:
        destroy_model_parallel()
        return
    _DETACHED.pop(id(state), None)
    destroy_model_groups(state)


def _release_megatron_resources() -> None:
    """What the served release's destroy_model_parallel also tears down outside parallel_state.

    Only modules already imported are touched (nothing was allocated in one that is not).
    """
    if FACTS.nccl_ep_finalize_on_destroy:
        fused = sys.modules.get("megatron.core.transformer.moe.fused_a2a")
        finalize = getattr(fused, "nccl_ep_finalize", None)
        if finalize is not None:
            try:
                finalize()
            except Exception:  # as in MCore: finalizing must never block teardown
                pass
    if FACTS.symmetric_memory_manager_destroy:
        symmetric = sys.modules.get("megatron.core.inference.symmetric_memory")
        manager = getattr(symmetric, "SymmetricMemoryManager", None)
        if manager is not None:
            manager.destroy()


def destroy_model_parallel() -> None:
    """Destroy every group ``initialize_model_parallel`` created and reset the module state.

    Like the served release, it also releases megatron's NCCL-EP context (0.19) and clears the
    symmetric-memory manager (0.17+) when those modules are loaded.
    """
    ns = _ns()
    state = _ACTIVE[0]
    _release_megatron_resources()
    _clear_module(ns)
    if state is not None:
        _DETACHED.pop(id(state), None)
        destroy_model_groups(state)


def abort_model_parallel(*, world: bool = False) -> AbortResult:
    """Abort every group this rank created and reset the module, without waiting for any peer.

    Not MCore API. For a rank whose peers died or stopped: where ``destroy_model_parallel``
    could wait for them, this issues no collective and no store operation. Every group the
    engine created in this process is aborted and unregistered from torch (the active grid,
    detached grids, grids, ``MegatronGroups`` and topologies alike; see
    :func:`parallel_state_ng.groups.abort.abort_groups`), and every module global is reset as
    ``destroy_model_parallel`` resets it, so ``initialize_model_parallel`` can run again (in a
    new world after an in-process restart). A later ``destroy_model_parallel`` or grid
    ``destroy()`` does nothing and returns at once. Call it outside ``use_state`` blocks (a
    block's exit restores the grid it suspended, whose groups are gone).

    Args:
        world: also abort the default group and every other group in torch's registry
            (needed before ``init_process_group`` can build a new world in this process).

    Returns:
        What was aborted (:class:`~parallel_state_ng.groups.abort.AbortResult`).
    """
    ns = _ns()
    states = [_ACTIVE[0], *(state for state, _ in _DETACHED.values()), *_SUSPENDED]
    _clear_module(ns)
    _DETACHED.clear()
    result = abort_groups(world=world)
    for state in states:
        if state is not None:
            state.handles.clear()
            state.created.clear()
            state.lease.release()  # the registry is empty after the abort: nothing is counted twice
    return result
