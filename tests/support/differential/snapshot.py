"""Observing a ``parallel_state`` module (:mod:`tests.support.differential.library`): group recording,
value encoding, snapshots and their comparison.

The value encoding is :func:`encode`'s; :mod:`tests.support.differential.library` says what a
snapshot holds.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.support.differential.api import ABSENT, MISSING, getter_calls, reference_globals

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
        if isinstance(pg, dist.ProcessGroup):  # binding only members' calls: most calls are not (big worlds)
            bound = sig.bind(*args, **kwargs).arguments
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
    """Plain, comparable encoding of a value (a call that raises: :func:`raised`).

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
    """
    return _Encoder()(value, track=False)


def raised(exc: BaseException) -> tuple:
    """Encoding of a raised exception: type name and the names along its MRO."""
    return ("raises", type(exc).__name__, tuple(t.__name__ for t in type(exc).__mro__))


#: The warnings log of the active :func:`warnings_recorded` block (None outside one).
_RECORDED: list | None = None


@contextlib.contextmanager
def warnings_recorded() -> Iterator[None]:
    """Record every warning (filter "always") for the :func:`_call` calls inside the block.

    One ``warnings.catch_warnings`` for a whole snapshot instead of one per call: entering it
    costs more than most getter calls (it copies the filter list and resets the caches).
    """
    global _RECORDED
    outer = _RECORDED
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _RECORDED = caught
        try:
            yield
        finally:
            _RECORDED = outer


def _call(fn: Callable, kwargs: dict) -> tuple[Any, tuple]:
    """Call ``fn(**kwargs)``; return (result or raised(...), categories of warnings emitted)."""
    if _RECORDED is None:
        with warnings_recorded():
            return _call(fn, kwargs)
    log, start = _RECORDED, len(_RECORDED)
    try:
        result = fn(**kwargs)
    except Exception as exc:
        result = exc
    emitted = tuple(sorted({w.category.__name__ for w in log[start:]}))
    del log[start:]
    return result, emitted


# --------------------------------------------------------------------------- snapshots


def _group_metadata(enc: _Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {}
    first_key: dict[int, str] = {}
    for path, group in enc.groups:
        record = _CREATED.get(id(group))
        rec = None if record is None or record[0] is not group else record[1]
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


def snapshot(ps: Any, rank: int | None = None) -> dict[str, Any]:
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
    with warnings_recorded():
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
# type compat raises instead (docs/differences.md: einops' EinopsError, e.g. 0.13's
# expert data-parallel split of an encoder's dp groups, or create_hierarchical_groups).
THIRD_PARTY_ERRORS = {"EinopsError": "RuntimeError"}


def equivalent(reference: Any, other: Any) -> bool:
    """``other`` matches ``reference``: equal, or both raise and ``other``'s type is a subclass
    (of the builtin base of a third-party type, :data:`THIRD_PARTY_ERRORS`).
    """
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
