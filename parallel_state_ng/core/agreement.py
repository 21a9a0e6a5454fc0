"""Cross-rank agreement check: ranks that pass different parallel settings fail fast.

If one rank calls ``initialize_model_parallel(tensor_model_parallel_size=2)`` and the others
pass 1, each rank computes different groups and waits for peers that never come: the job
hangs until the communication timeout, with no hint of the cause. :func:`check_agreement`
compares every rank's settings through the default process group's key-value store before
any group is created, and makes EVERY rank raise the same clear error instead:

* :class:`ParallelConfigMismatchError` when the settings differ: it names the ranks of each
  distinct configuration, the fields that differ and their values;
* :class:`ParallelConfigTimeoutError` when some rank does not arrive within ``timeout``: it
  names the ranks that are missing.

Protocol (one *round* per call, under a store prefix built from the check's name, its
participants and a per-call sequence number, so repeated checks never meet old keys):

1. each rank writes the JSON of its settings under the key of their hash (``cfg/<hash>``,
   identical value for agreeing ranks), writes the hash under its own key (``fp/<index>``)
   and increments an arrival counter with ``add``;
2. the rank whose ``add`` returns the participant count (the last to arrive; exactly one) reads
   every hash in one ``multi_get``, compares, and publishes a verdict (``compare_set``: the
   first verdict wins);
3. every rank waits for the verdict, bounded by ``timeout``, then removes its own ``fp`` key.

A rank therefore does 6 store operations whatever the world size (set, set, add, wait, get,
delete_key); only the last arrival reads O(world) data, in one request per 8,192 ranks. If the
verdict does not come in time, the first rank to claim the ``reporter`` key (``compare_set``)
finds the missing ranks (one ``check`` per participant, done by that rank alone and only on
this error path) and publishes a timeout verdict the others wait for a little longer. Keys
that must outlive a failed round stay, so a rank arriving late meets the same verdict instead
of waiting forever.

``compat.parallel_state.initialize_model_parallel`` runs the check by default
(:func:`check_initialize_agreement`; off with ``PSNG_AGREEMENT_CHECK=0`` or
:func:`set_agreement_check`; timeout from ``PSNG_AGREEMENT_TIMEOUT``, default 60 s).
``HyperCommGrid(..., check_agreement=True)`` runs it on request.

Every participant must make the same sequence of checks with a given name (true for SPMD code).
A rank that skipped one (it crashed and was recovered, or a test made it skip) is out of step
with the others until :func:`realign_sequences` is called on every rank.
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
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist

from parallel_state_ng.core.objects import all_gather_objects
from parallel_state_ng.core.sharing import group_sharing_enabled

__all__ = [
    "AgreementError",
    "ParallelConfigMismatchError",
    "ParallelConfigTimeoutError",
    "AgreementResult",
    "check_agreement",
    "check_initialize_agreement",
    "set_agreement_check",
    "agreement_check_settings",
    "canonical_json",
    "fingerprint",
    "realign_sequences",
    "measure_agreement_check",
    "DEFAULT_TIMEOUT_S",
    "ENV_ENABLE",
    "ENV_TIMEOUT",
]

ENV_ENABLE = "PSNG_AGREEMENT_CHECK"
ENV_TIMEOUT = "PSNG_AGREEMENT_TIMEOUT"
# Long enough for ranks that reach initialization at different times (imports, data loading
# on some nodes), short against the 10-30 minute communication timeouts that a hang costs.
DEFAULT_TIMEOUT_S = 60.0

_KEY_ROOT = "psng_agreement"
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
            parts = [f"{_show(v)} on {_ranks_text(r, n)}" for v, r, n in zip(values, rank_groups, group_sizes)]
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
        missing_ranks: Optional[list[tuple[int, int]]],
        missing_count: Optional[int],
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


# --------------------------------------------------------------------------- settings
_enabled_override: Optional[bool] = None
_timeout_override: Optional[float] = None


def _check_timeout(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def set_agreement_check(enabled: Optional[bool] = None, timeout_s: Optional[float] = None) -> tuple:
    """Turn the check in ``compat.parallel_state.initialize_model_parallel`` on or off.

    A value given here wins over the environment (``PSNG_AGREEMENT_CHECK``,
    ``PSNG_AGREEMENT_TIMEOUT``); ``None`` goes back to the environment / default. Affects this
    process only: set it the same way on every rank. Returns the previous ``(enabled,
    timeout_s)`` overrides, so a caller can restore them.
    """
    global _enabled_override, _timeout_override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {enabled!r}")
    if timeout_s is not None:
        timeout_s = _check_timeout(timeout_s, "timeout_s")
    previous = (_enabled_override, _timeout_override)
    _enabled_override, _timeout_override = enabled, timeout_s
    return previous


def agreement_check_settings() -> tuple[bool, float]:
    """The effective ``(enabled, timeout_s)`` of the check in ``initialize_model_parallel``."""
    enabled = _enabled_override
    if enabled is None:
        text = os.environ.get(ENV_ENABLE, "1").strip().lower()
        if text in ("", "1", "true", "yes", "on"):
            enabled = True
        elif text in ("0", "false", "no", "off"):
            enabled = False
        else:
            raise ValueError(f"environment variable {ENV_ENABLE} must be 0 or 1, got {os.environ[ENV_ENABLE]!r}")
    timeout = _timeout_override
    if timeout is None:
        text = os.environ.get(ENV_TIMEOUT)
        if text is None or not text.strip():
            timeout = DEFAULT_TIMEOUT_S
        else:
            try:
                value = float(text)
            except ValueError:
                value = text
            timeout = _check_timeout(value, f"environment variable {ENV_TIMEOUT}")
    return enabled, timeout


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
    if value is None or isinstance(value, (bool, str)):
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


# --------------------------------------------------------------------------- the round
@dataclass
class AgreementResult:
    """What one :func:`check_agreement` call did on this rank (returned when ranks agree).

    ``skipped`` with ``reason`` when no comparison was needed or possible (fake backend,
    single participant); ``store_ops`` is the number of store operations this rank issued;
    ``compared`` whether this rank was the one that compared all fingerprints.
    """

    name: str
    skipped: bool
    reason: str
    participants: int
    sequence: Optional[int] = None
    store_ops: int = 0
    compared: bool = False
    elapsed_s: float = 0.0


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


def _compare(ops: _Ops, ranks: Sequence[int]) -> dict:
    """Read every fingerprint and build the verdict (run by the last rank to arrive)."""
    n = len(ranks)
    hashes = ops.multi_get([f"fp/{i}" for i in range(n)])
    by_hash: dict[bytes, list[int]] = {}
    for i, h in enumerate(hashes):
        by_hash.setdefault(h, []).append(ranks[i])
    if len(by_hash) == 1:
        return {"status": "ok"}
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


def _run_round(store: Any, index: int, ranks: Sequence[int], fields: Mapping[str, Any], *, name: str, timeout: float) -> tuple[int, bool]:
    """One agreement round on an already prefixed ``store``; participant ``index`` of ``ranks``.

    Returns ``(store_ops, compared)`` when everyone agrees; raises otherwise.
    """
    n = len(ranks)
    deadline = time.monotonic() + timeout
    payload = canonical_json(fields)
    digest = hashlib.sha256(payload.encode()).hexdigest()[:32]
    ops = _Ops(store)
    ops.set(f"cfg/{digest}", payload)
    ops.set(f"fp/{index}", digest)
    compared = ops.add("arrived", 1) == n
    if compared:
        # Every participant wrote its fingerprint before adding, so all fp keys exist. A verdict
        # may already be there (the others timed out): compare_set keeps the first one.
        ops.compare_set("verdict", "", json.dumps(_compare(ops, ranks)))
    if not ops.wait_for("verdict", deadline - time.monotonic()):
        claim = ops.compare_set("reporter", "", str(index))
        if claim == str(index).encode():
            ops.compare_set("verdict", "", json.dumps(_find_missing(ops, ranks)))
        if not ops.wait_for("verdict", timeout):
            arrived = min(int(ops.add("arrived", 0)), n)
            _raise_for({"status": "timeout", "missing": None, "arrived": arrived}, name, n, timeout, False)
    verdict = json.loads(ops.get("verdict"))
    late = False
    if verdict.get("status") == "timeout":
        # Listed as missing: this rank wrote its fingerprint after the reporter looked.
        late = any(a <= ranks[index] <= b for a, b in verdict.get("missing") or [])
    else:
        ops.delete_key(f"fp/{index}")  # the verdict was computed from every fp: not needed again
    _raise_for(verdict, name, n, timeout, late)
    return ops.count, compared


# --------------------------------------------------------------------------- public entry
_sequences: dict[str, int] = {}


def _participants(group: Any) -> tuple[Sequence[int], str]:
    if group is None:
        world = dist.get_world_size()
        return range(world), f"world{world}"
    if isinstance(group, range):
        ranks: Sequence[int] = group
    elif isinstance(group, Sequence) and not isinstance(group, (str, bytes)):
        ranks = [int(r) for r in group]
    else:
        ranks = dist.get_process_group_ranks(group)
    if isinstance(ranks, range) and ranks.step == 1:
        return ranks, f"r{ranks.start}-{ranks.stop}"
    digest = hashlib.sha1(",".join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()[:16]
    return ranks, f"g{len(ranks)}-{digest}"


def check_agreement(
    fields: Mapping[str, Any],
    *,
    name: str,
    timeout: float,
    store: Any = None,
    group: Union[None, Sequence[int], Any] = None,
) -> AgreementResult:
    """Check that every participating rank passes equal ``fields``; raise on all ranks if not.

    Args:
        fields: the settings to compare (e.g. the arguments that shape the process groups),
            compared through :func:`canonical_json`.
        name: what is being checked (used in errors and in the store keys; checks with
            different names never interfere).
        timeout: seconds to wait for the other ranks.
        store: key-value store shared by the participants (default: the default process
            group's store).
        group: the participants: ``None`` for the whole world, a process group, or a
            sequence of global ranks (every participant must pass the same).

    Returns:
        An :class:`AgreementResult` when all agree (or the check was skipped).

    Raises:
        ParallelConfigMismatchError: on every participant, when the fields differ.
        ParallelConfigTimeoutError: when some participant does not arrive within ``timeout``.

    On the ``fake`` backend (simulated ranks in one process) the other ranks do not exist and
    the store is a dummy, so there is nothing to compare with: the check is skipped and the
    result says so. It is also skipped for a single participant.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    timeout = _check_timeout(timeout, "timeout")
    start = time.monotonic()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{name}: the agreement check needs torch.distributed to be initialized")
    backend = str(dist.get_backend())
    ranks, participants_id = _participants(group)
    if backend == "fake":
        return AgreementResult(name, True, "fake backend: the other ranks are simulated, nothing to compare", len(ranks))
    rank = dist.get_rank()
    try:
        index = ranks.index(rank)
    except ValueError:
        raise ValueError(f"{name}: rank {rank} is not among the participants of the check ({group!r})") from None
    if len(ranks) == 1:
        return AgreementResult(name, True, "single participant", 1)
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    key = f"{name}/{participants_id}"
    sequence = _sequences.get(key, 0)
    _sequences[key] = sequence + 1
    round_store = dist.PrefixStore(f"{_KEY_ROOT}/{key}/{sequence}/", store)
    ops, compared = _run_round(round_store, index, ranks, fields, name=name, timeout=timeout)
    return AgreementResult(name, False, "agreed", len(ranks), sequence, ops, compared, time.monotonic() - start)


def check_initialize_agreement(args: Mapping[str, Any], *, name: str = "initialize_model_parallel") -> Optional[AgreementResult]:
    """The check ``compat.parallel_state.initialize_model_parallel`` runs before anything else.

    ``args`` are all of its arguments (every one of them shapes the groups or their options).
    Returns ``None`` without communicating when the check is turned off
    (:func:`agreement_check_settings`) or ``torch.distributed`` is not initialized (the caller
    reports that itself); otherwise as :func:`check_agreement` over the whole world.
    """
    enabled, timeout = agreement_check_settings()
    if not enabled or not (dist.is_available() and dist.is_initialized()):
        return None
    fields = dict(args)
    # Ranks that disagree on sharing would create different numbers of groups: compare it too.
    fields["group sharing (PSNG_SHARE_GROUPS)"] = group_sharing_enabled()
    return check_agreement(fields, name=name, timeout=timeout)


def realign_sequences(group: Any = None) -> dict[str, int]:
    """Bring every rank's check sequence numbers to the highest among them (collective).

    Needed only after some rank skipped a check the others made (their next checks would
    otherwise look for each other under different keys and time out). Call it on every rank
    of ``group`` (default: the world); it gathers every rank's numbers once. Returns the new
    numbers. On the fake backend it only returns this process's numbers.
    """
    if str(dist.get_backend()) != "fake":
        gathered = all_gather_objects(dict(_sequences), group=group)  # numpy-free object gather
        for numbers_of_rank in gathered:
            for key, value in (numbers_of_rank or {}).items():
                _sequences[key] = max(_sequences.get(key, 0), value)
    return dict(_sequences)


# --------------------------------------------------------------------------- measurement
def _example_fields() -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": 8,
        "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": None,
        "pipeline_model_parallel_comm_backend": None,
        "use_sharp": False,
        "context_parallel_size": 2,
        "hierarchical_context_parallel_sizes": None,
        "hybrid_context_parallel": False,
        "expert_model_parallel_size": 8,
        "num_distributed_optimizer_instances": 1,
        "expert_tensor_parallel_size": None,
        "nccl_communicator_config_path": None,
        "distributed_timeout_minutes": 30,
        "order": "tp-cp-ep-dp-pp",
        "get_embedding_ranks": None,
        "get_position_embedding_ranks": None,
        "create_gloo_process_groups": True,
        "high_priority_stream_groups": None,
        "sharp_enabled_group": None,
        "create_all_gather_group": False,
    }


def measure_agreement_check(
    repeats: int = 20, *, fields: Optional[Mapping[str, Any]] = None, timeout: float = DEFAULT_TIMEOUT_S, barrier: bool = True
) -> dict[str, Any]:
    """Time :func:`check_agreement` on this rank; call it on EVERY rank of the world.

    Runs ``repeats`` checks of ``fields`` (default: a typical set of
    ``initialize_model_parallel`` arguments), each after a barrier when ``barrier`` (so the
    time is the check's, not the ranks' skew). Returns per-call seconds (``times_s``,
    ``median_s``, ``mean_s``, ``min_s``, ``max_s``), the world size, the store operations of
    a rank that did not compare (``store_ops_waiting``, constant) and of the comparing rank
    (``store_ops_comparing``; ``None`` if this rank never compared).
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    fields = _example_fields() if fields is None else fields
    times: list[float] = []
    waiting: Optional[int] = None
    comparing: Optional[int] = None
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        result = check_agreement(fields, name="agreement-benchmark", timeout=timeout)
        times.append(time.perf_counter() - t0)
        if result.compared:
            comparing = result.store_ops
        else:
            waiting = result.store_ops
    return {
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "repeats": repeats,
        "times_s": times,
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "min_s": min(times),
        "max_s": max(times),
        "store_ops_waiting": waiting,
        "store_ops_comparing": comparing,
    }
