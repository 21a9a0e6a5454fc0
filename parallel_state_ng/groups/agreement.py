"""Cross-rank agreement check: ranks that pass different parallel settings fail fast.

:func:`check_agreement` compares every rank's settings through the default store before any
group is created and makes every rank raise the same error on a difference or a missing rank,
instead of a hang. This module decides when a check runs and who takes part; each call is one
round of :mod:`parallel_state_ng.groups.agreement_protocol`, under a store prefix made of the
check's name, its participants and a per-call sequence number (repeated checks never meet old
keys). See docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups import creation
from parallel_state_ng.groups.agreement_protocol import (
    AgreementError,
    ParallelConfigMismatchError,
    ParallelConfigTimeoutError,
    Summarize,
    canonical_json,
    fingerprint,
    forget_deferred_deletes,
)
from parallel_state_ng.groups.agreement_protocol import run_round as _run_round
from parallel_state_ng.groups.objects import all_gather_objects
from parallel_state_ng.layout.bounded_input import shown

__all__ = [
    "AgreementError",
    "ParallelConfigMismatchError",
    "ParallelConfigTimeoutError",
    "AgreementResult",
    "check_agreement",
    "set_agreement_check",
    "agreement_check_settings",
    "canonical_json",
    "fingerprint",
    "realign_sequences",
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


# --------------------------------------------------------------------------- settings
_enabled_override: bool | None = None
_timeout_override: float | None = None


def check_timeout(value: Any, what: str) -> float:
    """``value`` as a float: a finite number of seconds > 0 (``ValueError`` naming ``what`` and the value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {shown(value)}")
    return float(value)


def set_agreement_check(enabled: bool | None = None, timeout_s: float | None = None) -> tuple:
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
        timeout_s = check_timeout(timeout_s, "timeout_s")
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
        raw = os.environ.get(ENV_TIMEOUT)
        if raw is None or not raw.strip():
            timeout = DEFAULT_TIMEOUT_S
        else:
            value: float | str
            try:
                value = float(raw)
            except ValueError:
                value = raw
            timeout = check_timeout(value, f"environment variable {ENV_TIMEOUT}")
    return enabled, timeout


# --------------------------------------------------------------------------- result
@dataclass
class AgreementResult:
    """What one :func:`check_agreement` call did on this rank (returned when ranks agree).

    ``skipped`` with ``reason`` when no comparison was needed or possible (fake backend,
    single participant); ``store_ops`` is the number of store operations this rank issued;
    ``compared`` whether this rank was the one that compared all fingerprints; ``summary`` what
    ``summarize`` made of the participants' rank values (``None`` without one).
    """

    name: str
    skipped: bool
    reason: str
    participants: int
    sequence: int | None = None
    store_ops: int = 0
    compared: bool = False
    elapsed_s: float = 0.0
    summary: Any = None


# --------------------------------------------------------------------------- public entry
_sequences: dict[str, int] = {}
creation.on_new_world(_sequences.clear)  # a new default group: every rank counts from 0 again
creation.on_new_world(forget_deferred_deletes)  # keys of an earlier world's store: never touched again


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
    group: None | Sequence[int] | Any = None,
    rank_value: str | None = None,
    summarize: Summarize | None = None,
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
        rank_value: this rank's own value (a str), not compared; with ``summarize`` (the same
            function on every participant) the comparing rank summarizes every participant's
            value and the summary reaches all in :attr:`AgreementResult.summary` (how the NVLink
            domain ids travel, :mod:`parallel_state_ng.groups.nvlink_check`). No extra round.
        summarize: ``summarize(ranks, values)``, run by the comparing rank on the participants'
            global ranks and rank values (``None`` for a rank that sent none); JSON-ready result.

    Returns:
        An :class:`AgreementResult` when all agree (or the check was skipped).

    Raises:
        ParallelConfigMismatchError: on every participant, when the fields differ.
        ParallelConfigTimeoutError: when some participant does not arrive within ``timeout``.

    Every participant makes the same sequence of checks with a given ``name`` (true for SPMD
    code); after a rank skipped one, see :func:`realign_sequences`.

    On the ``fake`` backend (simulated ranks in one process) the other ranks do not exist and
    the store is a dummy, so there is nothing to compare with: the check is skipped and the
    result says so. It is also skipped for a single participant.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    timeout = check_timeout(timeout, "timeout")
    start = time.monotonic()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{name}: the agreement check needs torch.distributed to be initialized")
    backend = str(dist.get_backend())
    ranks, participants_id = _participants(group)
    if backend == "fake":
        return AgreementResult(
            name, True, "fake backend: the other ranks are simulated, nothing to compare", len(ranks)
        )
    rank = dist.get_rank()
    try:
        index = ranks.index(rank)
    except ValueError:
        raise ValueError(f"{name}: rank {rank} is not among the participants of the check ({group!r})") from None
    if len(ranks) == 1:
        summary = None if summarize is None else summarize(ranks, [rank_value])
        return AgreementResult(name, True, "single participant", 1, summary=summary)
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    key = f"{name}/{participants_id}"
    creation.sync_world()
    sequence = _sequences.get(key, 0)
    _sequences[key] = sequence + 1
    round_store = dist.PrefixStore(f"{_KEY_ROOT}/{key}/{sequence}/", store)
    ops, compared, summary = _run_round(
        round_store, index, ranks, fields, name=name, timeout=timeout, rank_value=rank_value, summarize=summarize
    )
    elapsed = time.monotonic() - start
    return AgreementResult(name, False, "agreed", len(ranks), sequence, ops, compared, elapsed, summary)


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
