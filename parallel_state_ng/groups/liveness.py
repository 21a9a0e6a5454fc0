"""Failing fast when a rank dies or stops while groups are being created.

A gloo group is created with a short bound (:func:`creation_timeout`) after an arrival mark in
the default store, so a missing member makes the creation raise instead of waiting out the
group timeout; an init ends with a closing round (:class:`InitWatch`). Every survivor raises
:class:`RankFailureError` naming the dead ranks. :func:`agree_on_survivors` serves a restart.
See docs/reliability.md ("Fail fast while groups are created", with the limits found).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.agreement_protocol import flush_deferred_deletes, read_present
from parallel_state_ng.layout.bounded_input import shown

__all__ = [
    "RankFailureError",
    "InitWatch",
    "ENV_FAILURE_TIMEOUT",
    "failure_timeout",
    "creation_timeout",
    "grace_seconds",
    "guarded_create",
    "CreationContext",
    "agree_on_survivors",
]

#: Environment variable: seconds within which survivors raise when a rank dies during group
#: creation (default 30; 0 turns the bound and the closing round off).
ENV_FAILURE_TIMEOUT = "PSNG_FAILURE_TIMEOUT"
_ARRIVE = "psng-arrive/"
_FAILED = "psng-failed/"
_ROUND = "psng-init/"
# What gloo / the store say when a peer is missing or gone (anything else is a local error).
_PEER_TROUBLE = re.compile(r"timeout|timed out|connect|peer|socket|closed|reset|refused|broken pipe", re.IGNORECASE)
# Closing rounds made per (name, participants) in the current world (reset by naming.sync_world).
_sequences: dict[str, int] = {}


def reset_world_state() -> None:
    """Forget the per-world round counters (a new default group: every rank counts from 0)."""
    _sequences.clear()


class RankFailureError(RuntimeError):
    """A rank died or stopped while groups were being created; raised on every survivor.

    Attributes:
        dead: global ranks found missing (dead, stopped, or blocked behind a dead rank).
        step: what the raising rank was doing.
        reporter: the rank that saw the failure first (``None``: this rank).
        group: members of the group whose creation failed first, when known.
    """

    def __init__(self, message: str, *, dead: Sequence[int], step: str, reporter: int | None, group: Any = None):
        super().__init__(message)
        self.dead = sorted(set(dead))
        self.step = step
        self.reporter = reporter
        self.group = group


def env_seconds(name: str, default: float) -> float:
    """Seconds from environment variable ``name`` (``default`` when unset or blank).

    Raises:
        ValueError: the value is not a number.
    """
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # "nan", "inf" and "1e999" parse as floats but bound nothing
        raise ValueError(f"environment variable {name} must be a finite number of seconds, got {text[:80]!r}")
    return value


def failure_timeout() -> float:
    """The effective bound in seconds (0: off), from :data:`ENV_FAILURE_TIMEOUT`."""
    value = env_seconds(ENV_FAILURE_TIMEOUT, 30.0)
    if value < 0:
        raise ValueError(f"environment variable {ENV_FAILURE_TIMEOUT} must be >= 0, got {shown(value)}")
    return value


def creation_timeout() -> float:
    """Seconds a group's creation may wait for its members (0: unbounded, the caller's timeout)."""
    return 0.7 * failure_timeout()


def grace_seconds(bound: float | None = None) -> float:
    """How long a failing rank waits for the other members' failure records: a tenth of the
    failure bound ``bound`` (default: :func:`failure_timeout`), at least 1 s and at most 3 s.
    """
    return max(1.0, min(3.0, 0.1 * (failure_timeout() if bound is None else bound)))


def _grace() -> float:
    return grace_seconds()


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _watched() -> bool:
    """Whether failures are detected here: a real multi-process backend and the bound on."""
    return dist.is_initialized() and "fake" not in str(dist.get_backend()) and failure_timeout() > 0


def _short(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, list(ranks)[:limit]))
    return f"[{shown}{', ...' if len(ranks) > limit else ''}] ({len(ranks)} ranks)"


def _record_failure(store: Any, rank: int, info: dict) -> None:
    store.set(f"{_FAILED}{rank}", json.dumps({**info, "time": time.time()}))


def _failure_record(store: Any, rank: int, within: float) -> dict | None:
    """``rank``'s failure record if it appears within ``within`` seconds (and is recent)."""
    key = f"{_FAILED}{rank}"
    try:
        store.wait([key], timedelta(seconds=max(within, 0.001)))
        record = json.loads(store.get(key))
    except Exception:  # noqa: BLE001 - no record in time (or the store is gone): no story
        return None
    return record if time.time() - record.get("time", 0) < 4 * max(failure_timeout(), 1.0) else None


def _missing_members(store: Any, name: str, ranks: Sequence[int]) -> list[int]:
    """Members of group ``name`` without an arrival mark (one ``check`` each: error path only)."""
    return [r for r in ranks if not store.check([f"{_ARRIVE}{name}/{r}"])]


def _root_cause(store: Any, missing: list[int], rank: int) -> list[int]:
    """The dead among ``missing``: members with no failure record within the grace period.

    A member that is alive but failed elsewhere (blocked behind a dead rank) has a record;
    the ranks *it* found dead replace it. One whose record names nobody yet is alive and is
    not named.
    """
    deadline = time.monotonic() + _grace()
    dead: set[int] = set()
    for r in missing:
        record = _failure_record(store, r, deadline - time.monotonic())
        while record is not None and not record.get("dead") and time.monotonic() < deadline:
            time.sleep(0.05)
            record = _failure_record(store, r, 0.001)
        if record is None:
            dead.add(r)
        else:
            dead.update(x for x in record.get("dead") or [] if x != rank)
    return sorted(dead)


@dataclass(frozen=True)
class CreationContext:
    """What :func:`guarded_create` reads once per build instead of once per group.

    One build (an ``initialize_model_parallel``, a collection, a grid) creates many groups in
    the same world under the same settings; :meth:`current` reads them (environment, default
    backend, rank, store) and the build passes the object to every creation. It lives as long
    as the build: nothing is kept between builds.

    Attributes:
        bound: seconds a gloo group's creation may wait for its members (0: unbounded).
        default_backend: the default process group's backend (a group's when it names none).
        rank: this process's global rank.
        store: the default store (arrival marks, failure records); ``None`` when unbounded.
    """

    bound: float
    default_backend: str
    rank: int
    store: Any

    @classmethod
    def current(cls) -> CreationContext:
        """The settings in force now (unbounded when failures are not watched here)."""
        if not dist.is_initialized():
            return cls(0.0, "", 0, None)
        backend = str(dist.get_backend())
        bound = creation_timeout() if _watched() else 0.0  # once per build
        return cls(bound, backend, dist.get_rank(), _store() if bound else None)


def guarded_create(
    create: Callable[[dict], Any],
    ranks: Sequence[int],
    name: str,
    kwargs: dict,
    context: CreationContext | None = None,
    *,
    collective: bool = False,
) -> Any:
    """``create(kwargs)`` for group ``name`` over ``ranks``, bounded and with a named failure.

    For a gloo group with the bound on: this member's arrival mark first, the creation with
    the short timeout, then the caller's timeout restored. A creation that fails raises
    :class:`RankFailureError` naming the members that never arrived. ``context``: the
    build's :class:`CreationContext` (default: read now). ``collective``: a split of the
    default group, which every rank of ``ranks`` (the world) joins, bounded whatever the backend.
    """
    if context is None:
        context = CreationContext.current()
    if not context.bound or len(ranks) < 2:
        return create(kwargs)
    backend = kwargs.get("backend") or context.default_backend
    if "gloo" not in str(backend) and not collective:
        return create(kwargs)
    bound = timedelta(seconds=context.bound)
    store, rank = context.store, context.rank
    store.set(f"{_ARRIVE}{name}/{rank}", "")
    wanted = kwargs.get("timeout")
    if not isinstance(wanted, timedelta):
        wanted = dist.distributed_c10d._get_default_timeout(backend)  # type: ignore[arg-type]
    start = time.monotonic()
    try:
        group = create({**kwargs, "timeout": min(wanted, bound)})
    except Exception as exc:
        if not _PEER_TROUBLE.search(str(exc)):
            raise  # a local error (bad arguments, ...), not a peer's failure
        label = f"{kwargs['group_desc']} ({name})" if kwargs.get("group_desc") else name
        raise _creation_failure(store, rank, name, ranks, exc, time.monotonic() - start, label) from exc
    if wanted > bound and isinstance(group, dist.ProcessGroup):
        dist.distributed_c10d._set_pg_timeout(wanted, group)
    return group


def _creation_failure(
    store: Any, rank: int, name: str, ranks: Sequence[int], exc: Exception, took: float, label: str
) -> RankFailureError:
    desc = f"creating group {label} over ranks {_short(ranks)}"
    _record_failure(store, rank, {"dead": [], "step": desc})  # "alive, failed here": for the others
    missing = _missing_members(store, name, ranks)
    how = "never reached this group"
    if not missing:  # all arrived: whoever leaves no failure record died while connecting
        missing = [r for r in ranks if r != rank]
        how = "died while connecting (arrived, then left no failure record)"
    dead = _root_cause(store, missing, rank)
    _record_failure(store, rank, {"dead": dead, "step": desc})
    if dead and set(dead) <= set(missing):
        who = f"rank(s) {dead} {how}"
    elif dead:
        who = f"rank(s) {dead} died or stopped (found by the members {missing} this group waited for)"
    else:
        who = "no member could be named (every member left a failure record)"
    message = f"rank {rank}: {desc} failed after {took:.1f} s: {who} [{type(exc).__name__}: {str(exc)[:200]}]"
    return RankFailureError(message, dead=dead, step=desc, reporter=None, group=list(ranks))


class InitWatch:
    """The closing round of one init over ``ranks`` (docs/reliability.md: "Closing round").

    Usage, on every participant::

        watch = InitWatch("initialize_model_parallel", ranks)
        try:
            watch.step = "..."      # what this rank is doing, for the errors
            ...create groups...
            watch.finish()          # raises RankFailureError if any participant failed
        except BaseException as exc:
            error = watch.fail(exc) # publishes this rank's failure (first verdict wins)
            ...roll back...; raise error

    Every participant makes the same sequence of inits with a given name (SPMD), which tells
    repeated rounds apart. A no-op on the fake backend, with one participant, or with the
    bound off.
    """

    def __init__(self, name: str, ranks: Sequence[int]) -> None:
        self.name = name
        self.ranks = ranks
        self.active = _watched() and len(ranks) > 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.step = "starting"
        self.finished = False
        if self.active:
            key = f"{name}/{ranks[0]}-{ranks[-1]}-{len(ranks)}"
            sequence = _sequences.get(key, 0)
            _sequences[key] = sequence + 1
            self.store = dist.PrefixStore(f"{_ROUND}{key}/{sequence}/", _store())

    def finish(self) -> None:
        """Arrive at the closing round; return when every participant succeeded, else raise."""
        self.step = "the closing check"
        self.finished = True
        if not self.active:
            return
        index = self.ranks.index(self.rank)
        self.store.set(f"in/{index}", "")
        if self.store.add("count", 1) == len(self.ranks):
            # The last arrival (the rank the job waits for) learns the verdict from compare_set
            # itself: "ok", or a failure published first.
            verdict = self.store.compare_set("verdict", "", "ok").decode()
        else:
            flush_deferred_deletes()  # the agreement check's leftovers, while the others arrive
            verdict = self._wait_verdict(failure_timeout())
        if verdict == "ok":
            return
        raise self._error(verdict)

    def fail(self, exc: BaseException) -> BaseException:
        """Publish this rank's failure; return the error to raise.

        That is ``exc`` itself, unless ``exc`` is a peer failure this rank ran into and
        another rank published its failure first: then a :class:`RankFailureError` telling
        that rank's story (the root cause).
        """
        if not self.active or getattr(exc, "reporter", None) is not None:
            return exc
        own = not isinstance(exc, RankFailureError)  # a local error is raised as it is
        info = {
            "reporter": self.rank,
            "step": getattr(exc, "step", self.step),
            "dead": getattr(exc, "dead", []),
            "error": f"{type(exc).__name__}: {str(exc)[:300]}",
        }
        try:
            verdict = self.store.compare_set("verdict", "", json.dumps(info)).decode()
        except Exception:  # noqa: BLE001 - the store itself is gone (its host died): nothing to tell
            return exc
        if own or verdict in ("", "ok") or json.loads(verdict).get("reporter") == self.rank:
            return exc
        return self._error(verdict)

    def _wait_verdict(self, seconds: float) -> str:
        try:
            self.store.wait(["verdict"], timedelta(seconds=max(seconds, 0.001)))
        except Exception:  # noqa: BLE001 - nobody reported: name who never arrived
            missing = [r for i, r in enumerate(self.ranks) if not self.store.check([f"in/{i}"])]
            info = {"reporter": self.rank, "step": "the closing check", "dead": missing, "error": "timeout"}
            self.store.compare_set("verdict", "", json.dumps(info))
        return read_present(self.store, "verdict").decode()

    def _error(self, verdict: str) -> RankFailureError:
        info = json.loads(verdict)
        reporter, dead = info["reporter"], info.get("dead") or []
        named = f"rank(s) {dead} died or stopped" if dead else "a rank failed"
        if reporter == self.rank:
            where = f"{named}: they never reached {info['step']}"
        else:
            where = f"{named}; rank {reporter} saw it while {info['step']}: {info['error']}"
        message = f"rank {self.rank}: {self.name} failed during {self.step}: {where}"
        return RankFailureError(message, dead=dead, step=f"{self.name}: {self.step}", reporter=reporter)


def agree_on_survivors(store: Any, rank: int, world_size: int, *, wait_s: float, epoch: int = 0) -> list[int]:
    """The ranks of ``0 .. world_size - 1`` that are still alive, as every survivor sees them.

    For an in-process restart after a failure was detected (a collective raised or timed
    out): each survivor leaves a mark in ``store`` (the old world's store, which must still
    be served) and waits up to ``wait_s`` seconds for the others' marks; the dead leave none.
    ``wait_s`` must exceed the collective timeout that detected the failure, since a survivor
    blocked until that timeout marks late. ``epoch`` tells successive failures apart (every
    survivor passes the same). Survivors agree as long as each marks within the others'
    wait: one wait for all marks, then, when some are missing, one ``check`` per rank.

    Raises:
        ValueError: ``rank`` is not in the world, or ``wait_s`` is not positive.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if not wait_s > 0:
        raise ValueError(f"wait_s must be > 0 seconds, got {wait_s!r}")
    keys = [f"psng-alive/{epoch}/{r}" for r in range(world_size)]
    store.set(keys[rank], "")
    try:
        store.wait(keys, timedelta(seconds=wait_s))
        return list(range(world_size))
    except Exception:  # noqa: BLE001 - some mark did not come in time: find out whose
        return [r for r, key in enumerate(keys) if store.check([key])]
