"""The agreement check's store protocol: what one round writes, compares and raises.

:mod:`parallel_state_ng.groups.agreement` decides *when* a check runs and *who* takes part; this
module talks to the key-value store. One round (:func:`run_round`, which states the steps)
costs every rank 5 store operations whatever the world size, and ends on every rank with the
same verdict: agreement, :class:`ParallelConfigMismatchError` or
:class:`ParallelConfigTimeoutError`. See docs/reliability.md.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import numbers
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

__all__ = [
    "AgreementError",
    "ParallelConfigMismatchError",
    "ParallelConfigTimeoutError",
    "canonical_json",
    "fingerprint",
    "run_round",
    "flush_deferred_deletes",
    "forget_deferred_deletes",
    "read_present",
    "Summarize",
]

_MULTI_GET_CHUNK = 8192
_MAX_RANGES_SHOWN = 32
_MAX_CONFIGS_SHOWN = 16


# --------------------------------------------------------------------------- errors
class AgreementError(RuntimeError):
    """Base of the agreement-check errors; ``name`` is the check that failed."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class ParallelConfigMismatchError(AgreementError):
    """Ranks passed different settings.

    Attributes:
        rank_groups: the ranks of each distinct configuration, as inclusive ``(first, last)``
            ranges of global ranks, the largest group first (at most 32 ranges per group).
        group_sizes: number of ranks in each group.
        differences: field name -> its value in each group (same order as ``rank_groups``;
            values in canonical JSON form, ``"<absent>"`` for a field a group lacks).
    """

    def __init__(
        self,
        name: str,
        rank_groups: list[list[tuple[int, int]]],
        group_sizes: list[int],
        differences: dict[str, list[Any]],
        more_configs: int = 0,
    ) -> None:
        self.rank_groups = rank_groups
        self.group_sizes = group_sizes
        self.differences = differences
        self.more_configs = more_configs
        total = sum(group_sizes)
        lines = [
            f"{name}: the ranks were called with different arguments, so they could build different "
            f"process groups and hang. {len(group_sizes) + more_configs} distinct configurations among "
            f"{total} ranks (compared before any group was created); every rank must pass the same values:"
        ]
        for field_name, values in differences.items():
            parts = [
                f"{_show(v)} on {_ranks_text(r, n)}" for v, r, n in zip(values, rank_groups, group_sizes, strict=False)
            ]
            lines.append(f"  {field_name}: " + "; ".join(parts))
        if more_configs:
            lines.append(f"  ... and {more_configs} more configurations not shown")
        super().__init__("\n".join(lines), name)


class ParallelConfigTimeoutError(AgreementError):
    """Some ranks did not reach the check in time.

    Attributes:
        missing_ranks: global ranks that did not arrive, as inclusive ``(first, last)``
            ranges (``None`` when they could not be determined).
        arrived: how many ranks arrived (as far as known); ``expected``: participants.
        timeout_s: the timeout that expired.
    """

    def __init__(
        self,
        name: str,
        missing_ranks: list[tuple[int, int]] | None,
        missing_count: int | None,
        arrived: int,
        expected: int,
        timeout_s: float,
        late: bool = False,
    ) -> None:
        self.missing_ranks = missing_ranks
        self.missing_count = missing_count
        self.arrived = arrived
        self.expected = expected
        self.timeout_s = timeout_s
        if missing_ranks is None:
            who = f"{expected - arrived} rank(s) (which ones could not be determined)"
        else:
            who = _ranks_text(missing_ranks, missing_count or 0)
        if late:
            head = f"{name}: this rank arrived after the others gave up waiting for {who}"
        else:
            head = f"{name}: {who} did not reach the agreement check within {timeout_s:g} s"
        super().__init__(
            f"{head} ({arrived} of {expected} ranks arrived). They never called it, failed before "
            f"it, or are still busy; no process group was created.",
            name,
        )

    def missing_rank_list(self) -> list[int]:
        """The missing ranks expanded to a list (empty when unknown)."""
        return [r for first, last in self.missing_ranks or [] for r in range(first, last + 1)]


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)


def _ranks_text(ranges: list[tuple[int, int]], count: int) -> str:
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in ranges]
    shown = sum(b - a + 1 for a, b in ranges)
    text = ", ".join(parts)
    if count > shown:
        text += f", ... ({count} ranks)"
    word = "rank" if count == 1 else "ranks"
    return f"{word} {text}"


def _compress(ranks: Sequence[int], limit: int = _MAX_RANGES_SHOWN) -> list[tuple[int, int]]:
    """Sorted ranks as inclusive ranges, at most ``limit`` of them."""
    out: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        elif len(out) == limit:
            break
        else:
            out.append((r, r))
    return out


# --------------------------------------------------------------------------- fingerprints
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _callable_name(fn: Any) -> str:
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type(os)) and hasattr(fn, "__name__"):
        cls = owner if isinstance(owner, type) else type(owner)
        return f"{cls.__module__}.{cls.__qualname__}.{fn.__name__}"
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if qualname is None:  # an instance with __call__
        cls = type(fn)
        return f"{cls.__module__}.{cls.__qualname__}()"
    return f"{module}.{qualname}" if module else qualname


def _canonical(value: Any) -> Any:
    """A JSON value that is equal on two processes exactly when the settings mean the same."""
    if value is None or type(value) in (bool, str, int):  # the common cases first
        return value
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__qualname__}.{value.name}"}
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, os.PathLike):
        return {"path": os.fspath(value)}
    if isinstance(value, timedelta):
        return {"timedelta_s": value.total_seconds()}
    if isinstance(value, Mapping):
        return {"mapping": sorted([_canonical(k), _canonical(v)] for k, v in value.items())}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"set": sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(value, functools.partial):
        return {
            "partial": _callable_name(value.func),
            "args": _canonical(value.args),
            "keywords": _canonical(value.keywords),
        }
    if isinstance(value, numbers.Real):
        return _canonical(float(value))
    if callable(value):
        return {"callable": _callable_name(value)}
    cls = type(value)
    return {"object": f"{cls.__module__}.{cls.__qualname__}", "repr": _ADDRESS.sub("", repr(value))}


def canonical_json(fields: Mapping[str, Any]) -> str:
    """Canonical JSON of ``fields``: sorted keys, no whitespace, process-independent.

    Callables are represented by their qualified name (``module.qualname``), other objects
    by type and ``repr`` with memory addresses removed; ``True`` and ``1`` differ.
    """
    if not isinstance(fields, Mapping):
        raise TypeError(f"fields must be a mapping of setting name to value, got {type(fields).__name__}")
    return json.dumps({str(k): _canonical(v) for k, v in fields.items()}, sort_keys=True, separators=(",", ":"))


def fingerprint(fields: Mapping[str, Any]) -> str:
    """A 128-bit hex hash of :func:`canonical_json` of ``fields``."""
    return hashlib.sha256(canonical_json(fields).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- one round
class _Ops:
    """Store operations of one round, counted."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.count = 0

    def __getattr__(self, op: str):
        method = getattr(self.store, op)

        def counted(*args: Any) -> Any:
            self.count += 1
            return method(*args)

        return counted

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(keys), _MULTI_GET_CHUNK):
            chunk = keys[start : start + _MULTI_GET_CHUNK]
            self.count += 1
            try:
                out.extend(self.store.multi_get(chunk))
            except (RuntimeError, NotImplementedError, AttributeError):
                self.count += len(chunk) - 1
                out.extend(self.store.get(k) for k in chunk)
        return out

    def read_present(self, key: str) -> bytes:
        """The value of ``key``, which must exist (see :func:`read_present`)."""
        self.count += 1
        return read_present(self.store, key)

    def wait_for(self, key: str, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``key``; False on timeout."""
        self.count += 1
        seconds = max(seconds, 0.001)
        start = time.monotonic()
        try:
            self.store.wait([key], timedelta(seconds=seconds))
            return True
        except RuntimeError as exc:
            if "timeout" in str(exc).lower() or time.monotonic() - start >= seconds:
                return False
            raise


#: A value no verdict ever has (verdicts are JSON text).
_NEVER = "\x00"


def read_present(store: Any, key: str) -> bytes:
    """The value of ``key``, which the caller knows exists (it waited for it), in one round trip.

    ``TCPStore.get`` first waits for the key (one round trip) and then reads it (another);
    ``compare_set`` with an expected value the key never holds changes nothing and answers
    the current value in one.
    """
    return store.compare_set(key, _NEVER, _NEVER)


#: Separates a fingerprint from the rank's own value in an ``fp`` key (never in a hex digest).
_RANK_VALUE_SEP = b"\n"
#: Turns the participants' global ranks and their own values (``None``: sent none), in
#: participant order, into the JSON summary all of them receive.
Summarize = Callable[[Sequence[int], list[str | None]], Any]


def _compare(ops: _Ops, ranks: Sequence[int], summarize: Summarize | None = None) -> dict:
    """Read every fingerprint and build the verdict (run by the last rank to arrive).

    An ``fp`` value is the fingerprint, then optionally the rank's own value after
    :data:`_RANK_VALUE_SEP`; with ``summarize``, an ``ok`` verdict carries the summary of the
    values (in participant order) to every participant.
    """
    n = len(ranks)
    entries = ops.multi_get([f"fp/{i}" for i in range(n)])
    by_hash: dict[bytes, list[int]] = {}
    values: list[str | None] = []
    for i, entry in enumerate(entries):
        h, sep, value = entry.partition(_RANK_VALUE_SEP)
        values.append(value.decode() if sep else None)
        by_hash.setdefault(h, []).append(ranks[i])
    if len(by_hash) == 1:
        return {"status": "ok"} if summarize is None else {"status": "ok", "summary": summarize(ranks, values)}
    groups = sorted(by_hash.items(), key=lambda item: (-len(item[1]), min(item[1])))
    shown, more = groups[:_MAX_CONFIGS_SHOWN], len(groups) - _MAX_CONFIGS_SHOWN
    configs = [json.loads(ops.get(f"cfg/{h.decode()}")) for h, _ in shown]
    absent = "<absent>"
    names = sorted(set().union(*configs))
    differences = {}
    for field_name in names:
        values = [cfg.get(field_name, absent) for cfg in configs]
        if any(v != values[0] for v in values[1:]):
            differences[field_name] = values
    return {
        "status": "mismatch",
        "groups": [_compress(members) for _, members in shown],
        "sizes": [len(members) for _, members in shown],
        "differences": differences,
        "more": max(more, 0),
    }


def _find_missing(ops: _Ops, ranks: Sequence[int]) -> dict:
    """Timeout verdict: which participants never wrote their fingerprint (O(n), one rank)."""
    missing = [ranks[i] for i in range(len(ranks)) if not ops.check([f"fp/{i}"])]
    return {
        "status": "timeout",
        "missing": _compress(missing),
        "missing_count": len(missing),
        "arrived": len(ranks) - len(missing),
    }


def _raise_for(verdict: dict, name: str, n: int, timeout: float, late: bool) -> None:
    status = verdict.get("status")
    if status == "ok":
        return
    if status == "mismatch":
        raise ParallelConfigMismatchError(
            name,
            [[tuple(r) for r in g] for g in verdict["groups"]],
            verdict["sizes"],
            verdict["differences"],
            verdict.get("more", 0),
        )
    if status == "timeout":
        missing = verdict.get("missing")
        raise ParallelConfigTimeoutError(
            name,
            None if missing is None else [tuple(r) for r in missing],
            verdict.get("missing_count"),
            verdict["arrived"],
            n,
            timeout,
            late=late,
        )
    raise RuntimeError(f"{name}: unreadable agreement verdict {verdict!r}")


def run_round(
    store: Any,
    index: int,
    ranks: Sequence[int],
    fields: Mapping[str, Any],
    *,
    name: str,
    timeout: float,
    rank_value: str | None = None,
    summarize: Summarize | None = None,
) -> tuple[int, bool, Any]:
    """One agreement round on an already prefixed ``store``; participant ``index`` of ``ranks``.

    Every participant calls it with its own ``fields``; ``name`` is used in the errors and
    ``timeout`` (seconds) bounds the wait for the verdict. ``rank_value``: a value of this rank
    that is not compared (an NVLink domain id) but travels in the same ``fp`` key; the comparing
    rank passes every participant's value to ``summarize`` (every participant passes the same
    function) and the verdict brings the summary to all. No store operation is added.

    Each rank writes the JSON of its fields under ``cfg/<hash>`` and the hash under
    ``fp/<index>``, then increments an arrival counter (``add``). The rank whose ``add``
    returns the participant count reads every hash (one ``multi_get`` per 8,192 ranks),
    compares, and publishes the verdict with ``compare_set`` (the first verdict wins); the
    others wait for it and read it with :func:`read_present`. If it does not come in time,
    the first rank to claim the ``reporter`` key finds the missing ranks and publishes a
    timeout verdict. Keys a late rank needs outlive a failed round, so it meets the same
    verdict instead of waiting forever; ``fp`` keys are deleted later
    (:func:`flush_deferred_deletes`).

    Returns:
        ``(store_ops, compared, summary)`` when everyone agrees: the store operations this rank
        issued, whether it was the rank that compared every fingerprint, and the summary of
        the rank values (``None`` without ``summarize``).

    Raises:
        ParallelConfigMismatchError: the participants passed different ``fields``.
        ParallelConfigTimeoutError: some participant did not arrive within ``timeout``.
    """
    n = len(ranks)
    deadline = time.monotonic() + timeout
    payload = canonical_json(fields)
    digest = hashlib.sha256(payload.encode()).hexdigest()[:32]
    ops = _Ops(store)
    ops.set(f"cfg/{digest}", payload)
    if rank_value is not None and "\n" in rank_value:
        raise ValueError(f"{name}: a rank value must not contain a newline, got {rank_value!r}")
    ops.set(f"fp/{index}", digest if rank_value is None else f"{digest}\n{rank_value}")
    compared = ops.add("arrived", 1) == n
    if compared:
        # Every participant wrote its fingerprint before adding, so all fp keys exist. A verdict
        # may already be there (the others timed out): compare_set keeps the first one and
        # returns the verdict in force, so the last arrival (the one the job waits for) needs
        # no wait and no get.
        text = ops.compare_set("verdict", "", json.dumps(_compare(ops, ranks, summarize)))
    else:
        # While the others arrive: drop this rank's fingerprint of an earlier round (see below).
        flush_deferred_deletes()
        if not ops.wait_for("verdict", deadline - time.monotonic()):
            claim = ops.compare_set("reporter", "", str(index))
            if claim == str(index).encode():
                ops.compare_set("verdict", "", json.dumps(_find_missing(ops, ranks)))
            if not ops.wait_for("verdict", timeout):
                arrived = min(int(ops.add("arrived", 0)), n)
                _raise_for({"status": "timeout", "missing": None, "arrived": arrived}, name, n, timeout, False)
        text = ops.read_present("verdict")
    verdict = json.loads(text)
    late = False
    if verdict.get("status") == "timeout":
        # Listed as missing: this rank wrote its fingerprint after the reporter looked.
        late = any(a <= ranks[index] <= b for a, b in verdict.get("missing") or [])
    else:
        # The verdict was computed from every fp: not needed again. Deleted off the critical
        # path: while this rank waits in a later round (here, or the closing round of an init).
        _deferred_deletes.append((store, f"fp/{index}"))
    _raise_for(verdict, name, n, timeout, late)
    return ops.count, compared, verdict.get("summary")


#: Keys to delete once this rank has time to spare: ``(store, key)``, at most a few per rank.
_deferred_deletes: list[tuple[Any, str]] = []


def flush_deferred_deletes() -> int:
    """Delete the store keys earlier rounds left for later (call where the rank waits anyway).

    A round's fingerprint keys are needed until its verdict; each rank deletes its own one
    later instead of right after the verdict, where the delete would sit on the job's
    critical path. Returns the number of store operations issued. Keys of a store that is
    gone (a torn-down world) are dropped silently.
    """
    done = 0
    while _deferred_deletes:
        store, key = _deferred_deletes.pop()
        try:
            store.delete_key(key)
            done += 1
        except Exception:  # noqa: BLE001 - the store of an earlier world is gone: nothing to free
            pass
    return done


def forget_deferred_deletes() -> None:
    """Drop the deferred deletes without issuing them (their world's store is no longer used)."""
    _deferred_deletes.clear()
