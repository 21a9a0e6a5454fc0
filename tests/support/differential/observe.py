"""One full differential run (:mod:`tests.support.differential.library`): ``initialize_model_parallel``,
the setter phase, the calls made after init, destroy, and MCore's module state reset to import
time around each run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import megatron.core.parallel_state as mcore_ps
import torch.distributed as dist

from tests.support.differential.api import (
    ABSENT,
    MISSING,
    SETTER_VALUES,
    Call,
    classify_functions,
    reference_functions,
    reference_globals,
)
from tests.support.differential.snapshot import (
    _BARRIERS,
    _CUDA_CALLS,
    Difference,
    _call,
    _Encoder,
    _getattr,
    _group_metadata,
    encode,
    forget_recorded_groups,
    raised,
    recording,
    snapshot,
)

# --------------------------------------------------------------------------- a full run


_PRISTINE: dict[str, Any] | None = None


def _capture_pristine() -> dict[str, Any]:
    """The reference's globals at import time: ``None`` or an empty container (its type)."""
    global _PRISTINE
    if _PRISTINE is None:
        pristine: dict[str, Any] = {}
        for name in reference_globals():
            value = getattr(mcore_ps, name)
            if value is None:
                pristine[name] = None
            elif type(value) in (dict, list, set) and not value:
                pristine[name] = type(value)
            else:
                raise RuntimeError(
                    f"megatron.core.parallel_state.{name} is {value!r} before any test ran; "
                    "cannot know its pristine value"
                )
        _PRISTINE = pristine
    return _PRISTINE


def reset_mcore() -> None:
    """Put MCore's module state back to import time.

    ``destroy_model_parallel`` leaves several globals behind (``_HYBRID_DP_CP_GROUPS``
    entries, ``_PIPELINE_GLOBAL_RANKS``, ``_MPU_DATA_PARALLEL_RANK``, hierarchical CP
    groups, ...); a differential run must start from a clean reference.
    """
    for name, value in _capture_pristine().items():
        setattr(mcore_ps, name, value() if isinstance(value, type) else value)


_capture_pristine()


@contextlib.contextmanager
def preserved_environment() -> Iterator[None]:
    """Undo every change to ``os.environ`` made inside the block."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def env_diff(before: dict[str, str], after: dict[str, str]) -> tuple:
    """Sorted ``(name, value or None)`` for every environment variable that changed."""
    keys = set(before) | set(after)
    return tuple(sorted((k, after.get(k)) for k in keys if before.get(k) != after.get(k)))


@dataclass
class Observation:
    """What one ``initialize_model_parallel`` run showed.

    Besides getters and globals, an observation of ``initialize_model_parallel`` records the
    warning categories init emits (0.13: ``DeprecationWarning`` for encoder sizes), environment
    changes, barriers and the setter phase.
    """

    outcome: Any  # "ok" or raised(...)
    state: dict[str, Any]  # snapshot after init (or after the failure)
    setters: dict[str, Any]  # snapshot after the setter phase (empty after a failure)
    after_buffers: dict[str, Any]  # memory-buffer getters after destroy_global_*_buffer
    env: tuple
    barriers: tuple
    cuda_calls: tuple
    destroy: Any  # outcome of destroy_model_parallel()
    error_message: str = ""
    before: dict[str, Any] = field(default_factory=dict)  # snapshot before init, if asked
    after_init: dict[str, Any] = field(default_factory=dict)  # calls made after a good init
    after_destroy: dict[str, Any] = field(default_factory=dict)  # the reference's globals after destroy
    init_warnings: tuple = ()  # categories of the warnings initialize_model_parallel emitted

    def comparable(self) -> dict[str, Any]:
        """Flat dict of everything that must match between MCore and compat."""
        out: dict[str, Any] = {"init:outcome": self.outcome}
        if self.outcome == "ok":
            out["init:env"] = self.env
            out["init:warnings"] = self.init_warnings  # 0.13: DeprecationWarning for encoder sizes
            out["init:barriers"] = self.barriers
            out["init:cuda_calls"] = self.cuda_calls
            out.update(self.state)
            out.update(self.after_init)
            out.update({f"after_setters:{k}": v for k, v in self.setters.items()})
            out.update({f"after_destroy_buffers:{k}": v for k, v in self.after_buffers.items()})
            out["destroy:outcome"] = self.destroy
        return out


# Global buffers a release may have: ``get_<name>`` / ``destroy_<name>`` pairs (0.14-0.16 also
# have the symmetric-memory one; 0.17+ moved it out of parallel_state).
BUFFER_FUNCTIONS = ("global_memory_buffer", "global_symmetric_memory_buffer")


def _setter_phase(ps: Any, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    _, setters = classify_functions()
    returned: dict[str, Any] = {}
    for name in setters:
        fn = _getattr(ps, name)
        if fn is MISSING:
            returned[f"setter:{name}"] = MISSING
            continue
        result, warned = _call(lambda: fn(SETTER_VALUES[name]), {})
        returned[f"setter:{name}"] = raised(result) if isinstance(result, Exception) else encode(result)
        if warned:
            returned[f"warnings:setter:{name}"] = warned
    after = snapshot(ps, rank)
    after.update(returned)
    for name in setters:  # back to "not overridden"
        fn = _getattr(ps, name)
        if fn is not MISSING:
            _call(lambda: fn(None), {})
    buffers: dict[str, Any] = {}
    functions = reference_functions()
    for prefix in ("destroy_", "get_"):  # destroy every global buffer, then read them back
        for name in BUFFER_FUNCTIONS:
            if prefix + name not in functions:
                continue
            fn = _getattr(ps, prefix + name)
            result = MISSING if fn is MISSING else _call(fn, {})[0]
            buffers[prefix + name] = raised(result) if isinstance(result, Exception) else encode(result)
    for name in reference_globals():
        if name.startswith("_GLOBAL_") and name.endswith("_BUFFER"):
            buffers[f"global:{name}"] = encode(_getattr(ps, name))
    return after, buffers


def observe(
    ps: Any,
    rank: int,
    kwargs: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    cuda_stub: bool = False,
    setter_phase: bool = True,
    snapshot_before: bool = False,
    after_init: tuple[Call, ...] = (),
) -> Observation:
    """Run ``ps.initialize_model_parallel(**kwargs)`` on this rank of the current fake world.

    Environment changes are recorded and undone; the state is destroyed at the end (and, for
    MCore, reset to import time before and after). A failed init is recorded with the state it left behind.
    After a good init, each of ``after_init`` (e.g. 0.18's ``create_all_gather_groups``) is
    called on ``ps``: its result, the groups it returns (ranks, description, timeout) and the
    snapshot after all of them are part of the observation.
    """
    if ps is mcore_ps:  # start from import time even after other tests used MCore in this process
        reset_mcore()
    saved_env = dict(os.environ)
    os.environ.update(env or {})
    before_env = dict(os.environ)
    forget_recorded_groups()
    message = ""
    before = snapshot(ps, rank) if snapshot_before else {}
    try:
        with recording(cuda_stub=cuda_stub):
            result, init_warnings = _call(lambda: ps.initialize_model_parallel(**kwargs), {})
            outcome = raised(result) if isinstance(result, Exception) else "ok"
            if isinstance(result, Exception):
                first_line = (str(result).strip().splitlines() or [""])[0]
                message = f"{type(result).__name__}: {first_line[:200]}"
            env_changes = env_diff(before_env, dict(os.environ))
            state = snapshot(ps, rank)
            later: dict[str, Any] = {}
            if outcome == "ok" and after_init:
                later = _after_init_phase(ps, rank, after_init)
            setters, buffers = ({}, {})
            if outcome == "ok" and setter_phase:
                setters, buffers = _setter_phase(ps, rank)
            barriers, cuda_calls = tuple(_BARRIERS), tuple(_CUDA_CALLS)
        destroyed, _ = _call(ps.destroy_model_parallel, {})
        destroy = raised(destroyed) if isinstance(destroyed, Exception) else encode(destroyed)
        after_destroy = globals_after_destroy(ps)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        if ps is mcore_ps:
            reset_mcore()
        forget_recorded_groups()
    return Observation(
        outcome,
        state,
        setters,
        buffers,
        env_changes,
        barriers,
        cuda_calls,
        destroy,
        message,
        before,
        later,
        after_destroy,
        init_warnings,
    )


def globals_after_destroy(ps: Any) -> dict[str, Any]:
    """``global:<name>`` -> encoded value of every reference global (cheap: no getter calls)."""
    return {f"global:{name}": encode(_getattr(ps, name)) for name in reference_globals()}


def pristine_globals() -> dict[str, Any]:
    """``global:<name>`` -> encoded import-time value of every reference global."""
    return {
        f"global:{name}": encode(value() if isinstance(value, type) else value)
        for name, value in _capture_pristine().items()
    }


def destroy_differences(reference: dict[str, Any], other: dict[str, Any]) -> list[Difference]:
    """Globals after ``destroy_model_parallel`` that match neither the reference's nor import time.

    MCore's destroy leaves some globals set; compat may leave the same or reset them.
    """
    pristine = pristine_globals()
    return [
        Difference(key, value, other.get(key, ABSENT))
        for key, value in reference.items()
        if other.get(key, ABSENT) not in (value, pristine.get(key, ABSENT))
    ]


def _after_init_phase(ps: Any, rank: int, calls: tuple[Call, ...]) -> dict[str, Any]:
    enc = _Encoder()
    out: dict[str, Any] = {}
    for call in calls:
        fn = _getattr(ps, call.name)
        if fn is MISSING:
            out[f"after_init:{call.key}"] = MISSING
            continue
        result, warned = _call(fn, call.kwargs)
        key = f"after_init:{call.key}"
        out[key] = raised(result) if isinstance(result, Exception) else enc(result, key)
        if warned:
            out[f"warnings:{key}"] = warned
    out.update(_group_metadata(enc))
    # A returned group may or may not be the very object behind a module global (0.18 makes new
    # communicators for the all-gather groups): record which globals hold it.
    holders: dict[int, list[str]] = {}
    for name in reference_globals():
        value = _getattr(ps, name)
        if isinstance(value, dist.ProcessGroup):
            holders.setdefault(id(value), []).append(name)
    for path, group in enc.groups:
        out[f"held_by:{path}"] = tuple(holders.get(id(group), ()))
    out.update({f"after_init_state:{k}": v for k, v in snapshot(ps, rank).items()})
    return out
