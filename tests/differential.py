"""Differential-testing library: everything observable about a ``parallel_state`` module.

A module ``ps`` with Megatron-Core's ``parallel_state`` API (MCore itself, or
``compat.parallel_state``) is observed through a *snapshot*: a flat ``dict`` from a key (a
getter call with its arguments, a module global, ...) to a plain, comparable value. Two
snapshots taken in the same situation (same fake-backend world, same rank, same
``initialize_model_parallel`` arguments) can be compared with :func:`compare`.

The list of getters, setters and globals is derived from the *reference* module — the
``megatron.core.parallel_state`` importable in this process: the installed Megatron-Core, or,
inside a process bound to another release by ``tests/mcore_releases.activate``, that release
— never from the module under test. A getter the reference has and the tested module lacks
shows up as a ``("missing",)`` value, and a getter added to a newer Megatron-Core that this
file does not know how to call raises :class:`UnknownApiError`. Nothing here is written per
release: parameter values are keyed by parameter name, the functions to call come from the
reference's own namespace, pristine globals from the reference at import time.

Value encoding (see :func:`encode`):

* ``None``, ``bool``, ``int``, ``str``, ``float`` stay as they are (an int subclass such as
  ``numpy.int64`` becomes ``(type name, int)``);
* a ``ProcessGroup`` becomes ``("group", ranks)``; its metadata goes to extra keys
  ``meta:<key>`` (``group_desc``, the ``timeout`` / ``backend`` / ``pg_options`` it was
  created with) and ``alias:<key>`` (the first key holding the very same object, so shared
  communicators are visible);
* lists / tuples / dicts keep their type: ``("list", items)``, ``("tuple", items)``,
  ``("dict", sorted items)``; a group inside one gets its metadata keys under its index
  (``meta:<key>[1]``): 0.12/0.13's list of pipeline groups of an encoder rank and its rank
  lists compare by membership, order, description, timeout and backend of every element;
* anything else becomes ``("object", type name)``;
* a call that raises becomes ``("raises", type name, names of the type's MRO)``; compat may
  raise a subclass of MCore's exception type (code that catches MCore's still catches it), or
  of the builtin base of a third-party one (:data:`THIRD_PARTY_ERRORS`).

Besides getters and globals, an observation of ``initialize_model_parallel`` records the
warning categories init emits (0.13: ``DeprecationWarning`` for encoder sizes), environment
changes, barriers and the setter phase.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

import megatron.core.parallel_state as mcore_ps

MISSING = ("missing",)
ABSENT = ("absent",)


class UnknownApiError(RuntimeError):
    """The reference module has a public function this library does not know how to call."""


# --------------------------------------------------------------------------- the reference API


def reference_functions() -> dict[str, Callable]:
    """Public functions defined in the installed ``megatron.core.parallel_state``, in order."""
    return {
        name: obj
        for name, obj in vars(mcore_ps).items()
        if inspect.isfunction(obj) and obj.__module__ == mcore_ps.__name__ and not name.startswith("_")
    }


def reference_globals() -> list[str]:
    """Module-level state of the reference: ``_``-names that are not functions/classes/modules."""
    names = []
    for name, obj in vars(mcore_ps).items():
        if not name.startswith("_") or name.startswith("__"):
            continue
        if inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
            continue
        if type(obj).__module__ == "typing":
            continue
        names.append(name)
    return names


# Public functions that are not state getters, with the reason they are not called by
# :func:`snapshot`, for every supported release (a release lacks some of them; a name that no
# supported release has is reported as stale by the per-release test, which sees them all).
NOT_GETTERS: dict[str, str] = {
    "initialize_model_parallel": "the initializer itself",
    "destroy_model_parallel": "mutator; exercised by the harness",
    "destroy_global_memory_buffer": "mutator; exercised in the setter phase",
    "destroy_global_symmetric_memory_buffer": "mutator; exercised in the setter phase",
    "get_nccl_options": "stateless helper (pg_name, cfgs); compared by the helper tests",
    "update_pg_timeout": "collective + torch.cuda; compared by the helper tests",
    "create_group": "creates a group; compared by the helper tests",
    "generate_masked_orthogonal_rank_groups": "stateless helper; compared by the helper tests",
    "create_hierarchical_groups": "creates groups; compared by the helper tests",
    "create_hierarchical_parallel_groups": "creates groups (0.12); compared by the helper tests",
    "create_hybrid_dp_cp_groups": "creates groups; compared by the helper tests",
    "default_embedding_ranks": "stateless helper; compared by the helper tests",
    "default_position_embedding_ranks": "stateless helper; compared by the helper tests",
    "overwrite_nccl_comm_cfgs": "stateless helper; compared by the helper tests",
    "create_all_gather_groups": "creates groups after init (0.18+); exercised by observe(after_init=...)",
}

GETTER_PREFIXES = ("get_", "is_", "has_", "model_parallel_is_initialized")

# Values tried for each keyword parameter a getter may take.
_BOOL = (False, True)
VP_STAGES = (None, 0, 1, 2, 3)
# A pipeline rank (0.12/0.13 is_pipeline_stage_before/after_split, is_inside_encoder/decoder):
# the caller's own (None), and stages on both sides of a split rank or decoder start.
PIPELINE_RANKS = (None, 0, 1, 2, 3)


def _param_values(world_size: int) -> dict[str, tuple]:
    sizes = {None, 1, 3, world_size}
    p = 2
    while p <= 2 * world_size:
        sizes.add(p)
        p *= 2
    return {
        "check_initialized": (True, False),
        "with_context_parallel": _BOOL,
        "partial_data_parallel": _BOOL,
        "independent_all_gather": _BOOL,
        "tp_only_amax_red": _BOOL,
        "partial_expert_data_parallel": _BOOL,
        "with_gtp_remat": _BOOL,
        "with_egtp_remat": _BOOL,
        "ignore_virtual": (True, False),
        "vp_stage": VP_STAGES,
        "rank": PIPELINE_RANKS,
        "group_size": tuple(sorted(sizes, key=lambda s: -1 if s is None else s)),
    }


# Setters and the value each is set to in the setter phase (all are reset to None after).
SETTER_VALUES: dict[str, Any] = {
    "set_tensor_model_parallel_world_size": 7,
    "set_pipeline_model_parallel_world_size": 5,
    "set_virtual_pipeline_model_parallel_world_size": 3,
    "set_tensor_model_parallel_rank": 1,
    "set_pipeline_model_parallel_rank": 1,
    "set_virtual_pipeline_model_parallel_rank": 2,
    "set_data_parallel_rank": 3,
    "set_expert_model_parallel_world_size": 6,
    "set_expert_model_parallel_rank": 2,
    "set_expert_tensor_parallel_world_size": 4,
    "set_expert_tensor_parallel_rank": 1,
    "set_pipeline_model_parallel_split_rank": 2,  # 0.12/0.13
}


@dataclass
class Call:
    """One getter call: function name and keyword arguments."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


def classify_functions() -> tuple[list[str], list[str]]:
    """Split the reference's public functions into (getters, setters); fail on anything else."""
    functions = reference_functions()
    getters, setters = [], []
    for name in functions:
        if name in NOT_GETTERS:
            continue
        if name.startswith("set_"):
            if name not in SETTER_VALUES:
                raise UnknownApiError(f"setter {name} has no value in SETTER_VALUES")
            setters.append(name)
        elif name.startswith(GETTER_PREFIXES):
            getters.append(name)
        else:
            raise UnknownApiError(
                f"public function {name}{inspect.signature(functions[name])} is neither a getter "
                "(get_/is_/has_), a setter, nor listed in NOT_GETTERS: teach tests/differential.py"
            )
    return getters, setters


@functools.lru_cache(maxsize=None)
def getter_calls(world_size: int) -> tuple[Call, ...]:
    """Every getter call :func:`snapshot` makes: the no-argument call and every combination."""
    getters, _ = classify_functions()
    values = _param_values(world_size)
    functions = reference_functions()
    calls: list[Call] = []
    for name in getters:
        params = list(inspect.signature(functions[name]).parameters.values())
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise UnknownApiError(f"{name} takes *{p.name}: teach tests/differential.py")
            if p.name not in values:
                raise UnknownApiError(
                    f"getter {name} has parameter {p.name!r} with no known values: teach "
                    "tests/differential.py (_param_values)"
                )
        calls.append(Call(name))
        names = [p.name for p in params]
        for combo in itertools.product(*(values[n] for n in names)):
            if names:
                calls.append(Call(name, dict(zip(names, combo))))
    return tuple(calls)


# --------------------------------------------------------------------------- group recording


@dataclass
class GroupRecord:
    """How a process group was created (captured by :func:`recording`)."""

    timeout: Any
    backend: Any
    pg_options: Any


_CREATED: dict[int, tuple[Any, GroupRecord]] = {}
_BARRIERS: list[tuple] = []
_CUDA_CALLS: list[str] = []


def _timeout_repr(t: Any) -> Any:
    if t is None:
        return "default"
    if isinstance(t, timedelta):
        return f"{t.total_seconds() / 60:g}min"
    return ("object", type(t).__name__)


@contextlib.contextmanager
def recording(cuda_stub: bool = False) -> Iterator[None]:
    """Record ``torch.distributed.new_group`` kwargs and ``barrier`` calls; optionally stub CUDA.

    ``cuda_stub`` replaces ``torch.cuda.current_device`` (returns 0) and
    ``torch.cuda.synchronize`` (no-op) so the SHARP code paths can run on a CPU build.
    """
    original_new_group = dist.new_group
    original_barrier = dist.barrier
    sig = inspect.signature(original_new_group)

    def new_group(*args, **kwargs):
        pg = original_new_group(*args, **kwargs)
        bound = sig.bind(*args, **kwargs).arguments
        if isinstance(pg, dist.ProcessGroup):
            opts = bound.get("pg_options")
            _CREATED[id(pg)] = (
                pg,
                GroupRecord(
                    _timeout_repr(bound.get("timeout")),
                    bound.get("backend"),
                    None if opts is None else type(opts).__name__,
                ),
            )
        return pg

    def barrier(group=None, async_op=False, device_ids=None):
        _BARRIERS.append((encode(group), None if device_ids is None else tuple(device_ids)))
        return original_barrier(group=group, async_op=async_op, device_ids=device_ids)

    patches = [(dist, "new_group", new_group), (dist, "barrier", barrier)]
    if cuda_stub:
        patches += [
            (torch.cuda, "current_device", lambda: (_CUDA_CALLS.append("current_device"), 0)[1]),
            (torch.cuda, "synchronize", lambda *a, **k: _CUDA_CALLS.append("synchronize")),
        ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def forget_recorded_groups() -> None:
    """Drop the records of :func:`recording` (call between runs)."""
    _CREATED.clear()
    _BARRIERS.clear()
    _CUDA_CALLS.clear()


# --------------------------------------------------------------------------- encoding


class _Encoder:
    """Encodes values to plain data, collecting the groups seen and the keys they came from."""

    def __init__(self) -> None:
        self.groups: list[tuple[str, Any]] = []

    def __call__(self, value: Any, path: str = "", track: bool = True) -> Any:
        if value is None or type(value) in (bool, int, str, float):
            return value
        if isinstance(value, dist.ProcessGroup):
            if track:
                self.groups.append((path, value))
            try:
                return ("group", tuple(dist.get_process_group_ranks(value)))
            except Exception as exc:  # a group of a destroyed world
                return ("group", "unreadable", type(exc).__name__)
        if isinstance(value, int):  # bool-free int subclasses (numpy ints are not int)
            return (type(value).__name__, int(value))
        if type(value).__module__ == "numpy" and hasattr(value, "item"):
            return (type(value).__name__, value.item())
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return (kind, tuple(self(v, f"{path}[{i}]", track) for i, v in enumerate(value)))
        if isinstance(value, dict):
            items = sorted(value.items(), key=lambda kv: repr(kv[0]))
            return ("dict", tuple((self(k, "", False), self(v, f"{path}[{k!r}]", track)) for k, v in items))
        return ("object", type(value).__name__)


def encode(value: Any) -> Any:
    """Plain, comparable encoding of a value (see the module docstring)."""
    return _Encoder()(value, track=False)


def raised(exc: BaseException) -> tuple:
    """Encoding of a raised exception: type name and the names along its MRO."""
    return ("raises", type(exc).__name__, tuple(t.__name__ for t in type(exc).__mro__))


def _call(fn: Callable, kwargs: dict) -> tuple[Any, tuple]:
    """Call ``fn(**kwargs)``; return (result or raised(...), categories of warnings emitted)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn(**kwargs)
        except Exception as exc:
            result = exc
    return result, tuple(sorted({w.category.__name__ for w in caught}))


# --------------------------------------------------------------------------- snapshots


def _group_metadata(enc: _Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {}
    first_key: dict[int, str] = {}
    for path, group in enc.groups:
        record = _CREATED.get(id(group))
        rec = (None if record is None or record[0] is not group else record[1])
        desc = getattr(group, "group_desc", None)
        out[f"meta:{path}"] = (
            desc,
            "unrecorded" if rec is None else rec.timeout,
            "unrecorded" if rec is None else rec.backend,
            "unrecorded" if rec is None else rec.pg_options,
        )
        first = first_key.setdefault(id(group), path)
        if first != path:
            out[f"alias:{path}"] = first
    return out


def _getattr(ps: Any, name: str) -> Any:
    try:
        return getattr(ps, name)
    except AttributeError:
        return MISSING


def snapshot(ps: Any, rank: Optional[int] = None) -> dict[str, Any]:
    """Everything observable about ``ps`` on this rank, as a flat dict.

    Covers every getter of the reference (with every argument combination), the warnings each
    call emits, and every module global of the reference. ``rank`` (if given) must be the
    rank of the current default process group; it is recorded under ``"rank"``.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank is not None and dist.is_initialized() and rank != dist.get_rank():
        raise ValueError(f"snapshot(rank={rank}) but the default group's rank is {dist.get_rank()}")
    enc = _Encoder()
    out: dict[str, Any] = {"rank": rank}
    for call in getter_calls(world):
        fn = _getattr(ps, call.name)
        if fn is MISSING:
            out[call.key] = MISSING
            continue
        result, warned = _call(fn, call.kwargs)
        out[call.key] = raised(result) if isinstance(result, Exception) else enc(result, call.key)
        if warned:
            out[f"warnings:{call.key}"] = warned
    for name in reference_globals():
        value = _getattr(ps, name)
        key = f"global:{name}"
        if value is MISSING:
            out[key] = MISSING
        elif name == "_global_process_group_list" and isinstance(value, list):
            # Order of creation is an implementation detail; membership is what counts.
            members = [encode(g) for g in value]
            descs = [getattr(g, "group_desc", None) if g is not None else None for g in value]
            out[key] = ("multiset", tuple(sorted(zip(map(repr, members), map(repr, descs)))))
        else:
            out[key] = enc(value, key)
    out.update(_group_metadata(enc))
    return out


def snapshot_uninitialized(ps: Any) -> dict[str, Any]:
    """What every getter returns or raises (and every global holds) with no model parallel state.

    Call it before ``initialize_model_parallel`` or after ``destroy_model_parallel``; it works
    with or without a default process group.
    """
    rank = dist.get_rank() if dist.is_initialized() else None
    snap = snapshot(ps, rank)
    snap["dist_initialized"] = dist.is_initialized()
    return snap


# --------------------------------------------------------------------------- comparison


# Exceptions MCore raises from a third-party library compat does not use -> the builtin base
# type compat raises instead (README, "Compatibility notes": einops' EinopsError, e.g. 0.13's
# expert data-parallel split of an encoder's dp groups, or create_hierarchical_groups).
THIRD_PARTY_ERRORS = {"EinopsError": "RuntimeError"}


def equivalent(reference: Any, other: Any) -> bool:
    """``other`` matches ``reference``: equal, or both raise and ``other``'s type is a subclass
    (of the builtin base of a third-party type, :data:`THIRD_PARTY_ERRORS`)."""
    if reference == other:
        return True
    return (
        isinstance(reference, tuple)
        and isinstance(other, tuple)
        and len(reference) == 3
        and len(other) == 3
        and reference[0] == "raises"
        and other[0] == "raises"
        and (reference[1] in other[2] or THIRD_PARTY_ERRORS.get(reference[1]) in other[2])
    )


@dataclass
class Difference:
    """One key whose values differ between the reference and the other snapshot."""

    key: str
    reference: Any
    other: Any

    def __str__(self) -> str:
        return f"{self.key}:\n    mcore : {_short(self.reference)}\n    other : {_short(self.other)}"


def _short(value: Any, limit: int = 800) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 40] + f" ... <{len(text) - limit + 40} more chars>"


def compare(reference: dict[str, Any], other: dict[str, Any]) -> list[Difference]:
    """All differing keys (reference order first, then keys only ``other`` has)."""
    diffs = []
    for key, value in reference.items():
        other_value = other.get(key, ABSENT)
        if not equivalent(value, other_value):
            diffs.append(Difference(key, value, other_value))
    for key, value in other.items():
        if key not in reference:
            diffs.append(Difference(key, ABSENT, value))
    return diffs


def describe(diffs: list[Difference], limit: int = 12) -> str:
    """Human-readable report: the first ``limit`` differences and a count per key kind."""
    if not diffs:
        return "no differences"
    kinds: dict[str, int] = {}
    for d in diffs:
        kind = d.key.split(":", 1)[0] if ":" in d.key.split("(", 1)[0] else "call"
        kinds[kind] = kinds.get(kind, 0) + 1
    head = f"{len(diffs)} differing keys ({', '.join(f'{k}: {n}' for k, n in sorted(kinds.items()))})"
    body = "\n".join(str(d) for d in diffs[:limit])
    more = f"\n... and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return f"{head}\nfirst differing key: {diffs[0].key}\n{body}{more}"


# --------------------------------------------------------------------------- a full run


_PRISTINE: Optional[dict[str, Any]] = None


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
    """What one ``initialize_model_parallel`` run showed."""

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
    env: Optional[dict[str, str]] = None,
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
    return Observation(outcome, state, setters, buffers, env_changes, barriers, cuda_calls, destroy, message, before,
                       later, after_destroy, init_warnings)


def globals_after_destroy(ps: Any) -> dict[str, Any]:
    """``global:<name>`` -> encoded value of every reference global (cheap: no getter calls)."""
    return {f"global:{name}": encode(_getattr(ps, name)) for name in reference_globals()}


def pristine_globals() -> dict[str, Any]:
    """``global:<name>`` -> encoded import-time value of every reference global."""
    return {f"global:{name}": encode(value() if isinstance(value, type) else value)
            for name, value in _capture_pristine().items()}


def destroy_differences(reference: dict[str, Any], other: dict[str, Any]) -> list[Difference]:
    """Globals after ``destroy_model_parallel`` that match neither the reference's nor import time.

    MCore's destroy leaves some globals set; compat may leave the same or reset them.
    """
    pristine = pristine_globals()
    return [Difference(key, value, other.get(key, ABSENT)) for key, value in reference.items()
            if other.get(key, ABSENT) not in (value, pristine.get(key, ABSENT))]


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


def fake_world(rank: int, world_size: int) -> None:
    """(Re)initialize the default process group as a fake-backend world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
