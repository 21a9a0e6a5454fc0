"""Sleep and wake of the process groups a rank holds, behind the same group objects (issue 51).

An RL job that alternates training and a rollout engine on the same GPUs puts its
communicators to sleep between phases and wakes them after, while Megatron keeps holding the
very same ``ProcessGroup`` objects (compared with ``is``). :func:`sleep` and :func:`wake` (and
the context manager :func:`asleep`) do that over a set of live groups, by default every group
:func:`~parallel_state_ng.groups.creation.live_groups` lists. Every rank of the world calls
them together: a bounded store round (:func:`~parallel_state_ng.groups.agreement.check_agreement`)
makes every rank raise, naming the missing one, instead of one rank sleeping alone.

What happens to a group, reported per group in :class:`SleepReport`:

* ``native``: the backend suspends itself (``Backend.suspend()`` / ``resume()``; NCCL 2.29.7
  or later under torch 2.13). ``bytes_freed`` comes from ``Backend.memory_stats()`` when the
  backend reports it, else ``None``.
* ``fenced``: the backend cannot suspend (gloo: "does not support suspend") and torch offers no
  way to release it behind the same handle: a ``ProcessGroup`` keeps the first backend
  registered for each backend type and has no call that removes one (torch 2.13,
  ``ProcessGroup::setBackend`` in ``ProcessGroup.hpp``: registering a type already present
  reuses the backend held), and torch refuses Python subclasses of ``Backend`` ("No
  constructor defined"). Its resources stay; nothing is freed (``bytes_freed`` ``None``).
* ``mixed``: some of the group's backends suspend, the others are fenced (``cpu:gloo,cuda:nccl``).
* ``skipped`` with the reason: already asleep, not asleep, torch's fake backend, or a torch
  without the guard below (the group then stays awake).

Every group put to sleep (native or fenced) is fenced: its devices are routed to a guard
backend (torch's ``FakeProcessGroup`` with ``error_on_collective``) registered under a backend
type the group does not use, and its default backend switched to it; wake routes them back to
the original backends (same objects, same sequence numbers). A collective through
``torch.distributed`` on a sleeping group raises :class:`GroupAsleepError` at once, naming the
group's ``group_desc`` and saying to wake it first; a call on the group's own methods (C++
paths) raises torch's guard error. The guard's point-to-point calls (``send``/``recv`` on the
group object itself) do not raise in torch 2.13: only ``torch.distributed``'s functions are
guarded for those.

Sleeping a group that sleeps, or waking one that is awake, is a no-op reported as ``skipped``
(the agreement round still runs: every rank calls every time). A group may be destroyed while
it sleeps; the next sleep or wake forgets it. Names, ranks, timeout,
``group_desc`` and torch's bookkeeping (``pg_map``, ``pg_names``) are never touched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel_state_ng.groups import agreement, creation
from parallel_state_ng.layout.sharing_policy import DESC_JOIN

__all__ = [
    "GroupAsleepError",
    "GroupOutcome",
    "SleepReport",
    "sleep",
    "wake",
    "asleep",
    "is_asleep",
    "DEFAULT_TIMEOUT_S",
]

#: Seconds every rank waits for the others to reach a sleep or wake (the agreement round).
DEFAULT_TIMEOUT_S = 60.0
_CHECK_NAME = "psng-sleep"
# Backend types a guard may take, in order of preference: the first one the group does not use.
_GUARD_TYPES = ("CUSTOM", "UCC", "MPI", "XCCL", "UNDEFINED")


class GroupAsleepError(RuntimeError):
    """A collective was called on a group that sleeps: wake it first."""


@dataclass
class GroupOutcome:
    """What one sleep or wake did to one group on this rank.

    ``mechanism``: ``"native"``, ``"fenced"``, ``"mixed"`` (some of the group's backends
    suspended, the others fenced: ``cpu:gloo,cuda:nccl``) or ``"skipped"`` (``reason`` says why);
    ``bytes_freed``: the drop of the suspended backends' summed ``memory_stats()`` counters
    (``memory_before``/``memory_after``, keys ``<backend>:<key>``), ``None`` where no backend
    reports them.
    """

    desc: str
    name: str
    backends: list[str]
    mechanism: str
    reason: str = ""
    bytes_freed: int | None = None
    memory_before: dict[str, int] | None = None
    memory_after: dict[str, int] | None = None


@dataclass
class SleepReport:
    """One :func:`sleep` or :func:`wake` on this rank: the agreement round and each group's outcome."""

    action: str
    groups: list[GroupOutcome] = field(default_factory=list)
    agreement: agreement.AgreementResult | None = None

    def by_mechanism(self, mechanism: str) -> list[GroupOutcome]:
        """The outcomes whose mechanism is ``mechanism``."""
        return [g for g in self.groups if g.mechanism == mechanism]


@dataclass
class _Slept:
    """A sleeping group: how to route it back and what to resume."""

    group: Any
    routes: list[tuple[torch.device, Any, Any]]  # (device, backend type, backend)
    default_type: Any
    native: list[Any]


# id(group) -> its state while asleep (the group itself is held only while it sleeps).
_asleep: dict[int, _Slept] = {}
# id(group) -> (weak reference to the group, its guard backend, the guard's backend type): the guard
# stays registered in the group's slot for the group's life; a later sleep routes to it again.
_guards: dict[int, tuple[Any, Any, Any]] = {}
# The torch function wrapped while some group sleeps, and its original.
_PATCHED = "_rank_not_in_group"
_original: list[Any] = []


def _forget_world() -> None:
    _asleep.clear()
    _guards.clear()
    _unpatch()


creation.on_new_world(_forget_world)


def is_asleep(group: Any) -> bool:
    """Whether ``group`` sleeps (was put to sleep here and not woken)."""
    state = _asleep.get(id(group))
    return state is not None and state.group is group


def _desc(group: Any) -> str:
    return str(getattr(group, "group_desc", "") or "") or str(getattr(group, "group_name", "?"))


def _asleep_message(group: Any) -> str:
    return (
        f"process group {_desc(group)!r} (name {group.group_name!r}) is asleep: wake it first "
        "(parallel_state_ng.groups.sleep.wake) before any collective on it"
    )


# --------------------------------------------------------------------------- the Python-side guard
def _patch() -> None:
    """Wrap torch's membership check, which every ``torch.distributed`` collective calls first."""
    if _original:
        return
    c10d: Any = dist.distributed_c10d
    original = getattr(c10d, _PATCHED)

    def guarded(group: Any = None) -> bool:
        if group is not None and is_asleep(group):
            raise GroupAsleepError(_asleep_message(group))
        return original(group)

    _original.append(original)
    setattr(c10d, _PATCHED, guarded)


def _unpatch() -> None:
    if _original:
        setattr(dist.distributed_c10d, _PATCHED, _original.pop())


# --------------------------------------------------------------------------- one group
def _routes(group: Any) -> list[tuple[torch.device, Any, Any]]:
    """(device, backend type, backend) for each device the group has a backend for."""
    types = dist.Backend.backend_type_map
    routes = []
    for device in group._device_types:
        backend = group._get_backend(device)
        routes.append((device, types.get(backend.name().lower(), dist.ProcessGroup.BackendType.CUSTOM), backend))
    return routes


def _default_type(group: Any) -> Any:
    return dist.Backend.backend_type_map.get(group._get_backend_name().lower(), dist.ProcessGroup.BackendType.CUSTOM)


def _guard_for(group: Any, used: set[Any]) -> tuple[Any, Any] | str:
    """The group's guard backend and its type (made and remembered on the first sleep), or why none."""
    known = _guards.get(id(group))
    if known is not None and known[0]() is group:
        return known[1], known[2]
    free = [t for t in (getattr(dist.ProcessGroup.BackendType, n) for n in _GUARD_TYPES) if t not in used]
    fake: Any = getattr(torch._C._distributed_c10d, "FakeProcessGroup", None)  # the stub lacks its options
    options: Any = fake.Options() if fake is not None and hasattr(fake, "Options") else None
    if not hasattr(options, "error_on_collective"):
        return f"torch {torch.__version__} has no refusing guard backend (FakeProcessGroup error_on_collective)"
    if not free:
        return "every backend type is taken: no slot for the guard"
    options.error_on_collective = True
    guard = fake._create_internal(group.rank(), group.size(), options)
    _guards[id(group)] = (weakref.ref(group), guard, free[0])
    return guard, free[0]


def _stats(backend: Any) -> dict[str, int] | None:
    """The backend's ``memory_stats()`` under ``<backend name>:<key>``, or ``None`` without them."""
    try:
        stats = backend.memory_stats()
    except (AttributeError, RuntimeError):  # older torch; "does not support getMemoryStats"
        return None
    return {f"{backend.name()}:{k}": int(v) for k, v in stats.items()}


def _suspend(backend: Any) -> bool:
    """Suspend ``backend``; ``False`` when it cannot (gloo, or a torch without ``suspend``)."""
    if not hasattr(backend, "suspend"):
        return False
    try:
        backend.suspend()
    except RuntimeError as err:
        if "does not support suspend" in str(err):
            return False
        raise
    return True


def _resume(backend: Any) -> None:
    backend.resume()


def _sleep_one(group: Any) -> GroupOutcome:
    routes = _routes(group)
    names = [backend.name() for _, _, backend in routes]
    outcome = GroupOutcome(_desc(group), str(group.group_name), names, "skipped")
    if is_asleep(group):
        outcome.reason = "already asleep"
        return outcome
    if not routes or "fake" in names:
        outcome.reason = "torch's fake backend: nothing to release" if routes else "no backend registered"
        return outcome
    found = _guard_for(group, {t for _, t, _ in routes})
    if isinstance(found, str):  # without a guard a sleeping group could be used: stay awake
        outcome.reason = found
        return outcome
    guard, guard_type = found
    before: dict[str, int] = {}
    native: list[Any] = []
    unsupported: list[str] = []
    for backend in {id(b): b for _, _, b in routes}.values():  # one backend may serve several devices
        stats = _stats(backend)
        try:
            suspended = _suspend(backend)
        except BaseException:
            for done in native:  # leave the group as it was
                _resume(done)
            raise
        if not suspended:
            unsupported.append(backend.name())
            continue
        native.append(backend)
        before.update(stats or {})
    default_type = _default_type(group)
    for device, _, _ in routes:
        group._register_backend(device, guard_type, guard)
    group._set_default_backend(guard_type)
    _asleep[id(group)] = _Slept(group, routes, default_type, native)
    if native:
        outcome.mechanism = "mixed" if unsupported else "native"
        outcome.reason = f"Backend.suspend() of {'/'.join(b.name() for b in native)}"
        if before:
            after: dict[str, int] = {}
            for backend in native:
                after.update(_stats(backend) or {})
            outcome.memory_before, outcome.memory_after = before, after
            outcome.bytes_freed = sum(before.values()) - sum(after.values())
    if unsupported:
        fenced = (
            f"backend {'/'.join(unsupported)} cannot suspend and torch cannot release a backend behind "
            "the same ProcessGroup: refused until wake, nothing freed"
        )
        outcome.reason = f"{outcome.reason}; {fenced}" if native else fenced
        if not native:
            outcome.mechanism = "fenced"
    return outcome


def _wake_one(group: Any) -> GroupOutcome:
    state = _asleep.get(id(group))
    if state is None or state.group is not group:
        routes = _routes(group)
        names = [backend.name() for _, _, backend in routes]
        return GroupOutcome(_desc(group), str(group.group_name), names, "skipped", "not asleep")
    names = [backend.name() for _, _, backend in state.routes]
    for backend in state.native:
        _resume(backend)
    for device, backend_type, backend in state.routes:
        group._register_backend(device, backend_type, backend)  # the slot holds this very backend
    group._set_default_backend(state.default_type)
    del _asleep[id(group)]
    unsuspended = [r for r in state.routes if not any(r[2] is b for b in state.native)]
    mechanism = ("mixed" if unsuspended else "native") if state.native else "fenced"
    reason = "Backend.resume(), routed back" if state.native else "routed back to its backends"
    return GroupOutcome(_desc(group), str(group.group_name), names, mechanism, reason)


# --------------------------------------------------------------------------- the public calls
def _prune() -> None:
    """Forget groups destroyed while asleep, and the guards of groups gone."""
    world = dist.distributed_c10d._world.pg_map
    for key in [k for k, state in _asleep.items() if state.group not in world]:
        del _asleep[key]
    for key in [k for k, (ref, _, _) in _guards.items() if ref() is None]:
        del _guards[key]
    if not _asleep:
        _unpatch()


def _checked(groups: Any, kinds: Any, timeout: Any) -> tuple[list[Any] | None, list[str] | None]:
    """The arguments of a public call, checked before anything else runs: ``groups`` and ``kinds`` as lists.

    Raises:
        TypeError: ``groups`` or ``kinds`` is not an iterable (a ``str`` counts as none), or holds
            something that is not a process group (``None`` aside), or not a kind name.
        ValueError: ``timeout`` is not a finite number of seconds > 0.
    """
    agreement.check_timeout(timeout, "timeout")
    for name, value in (("groups", groups), ("kinds", kinds)):
        if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, Iterable)):
            shown = f"{name}={value!r} ({type(value).__name__})"
            raise TypeError(f"{name} must be an iterable (not a str) or None, got {shown}")
    kinds = None if kinds is None else list(kinds)
    bad_kinds = [k for k in kinds or () if not isinstance(k, str) or not k]
    if bad_kinds:
        raise TypeError(f"kinds must hold kind names (non-empty str, e.g. 'DATA_PARALLEL'), got {bad_kinds!r}")
    listed = None if groups is None else list(groups)
    bad = [g for g in listed or () if g is not None and not isinstance(g, dist.ProcessGroup)]
    if bad:
        raise TypeError(f"groups must hold torch ProcessGroups (or None), got {bad[0]!r} ({type(bad[0]).__name__})")
    return listed, kinds


def _selected(groups: Iterable[Any] | None, kinds: Iterable[str] | None) -> list[Any]:
    """The groups to act on: live ones by default, each once, members only, of ``kinds``."""
    chosen = creation.live_groups() if groups is None else list(groups)
    wanted = None if kinds is None else {str(k) for k in kinds}
    world = dist.distributed_c10d._world.pg_map
    seen: set[int] = set()
    out = []
    for group in chosen:
        if not isinstance(group, dist.ProcessGroup) or id(group) in seen or group not in world:
            continue
        if wanted is not None and not wanted.intersection(_desc(group).split(DESC_JOIN)):
            continue
        seen.add(id(group))
        out.append(group)
    return out


def _agree(action: str, kinds: Iterable[str] | None, timeout: float) -> agreement.AgreementResult:
    fields = {"action": action, "kinds": None if kinds is None else sorted(str(k) for k in kinds)}
    return agreement.check_agreement(fields, name=_CHECK_NAME, timeout=timeout)


def sleep(
    groups: Iterable[Any] | None = None,
    *,
    kinds: Iterable[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> SleepReport:
    """Put ``groups`` to sleep on this rank, once every rank of the world calls it too.

    Args:
        groups: the process groups (default: every live group of
            :func:`~parallel_state_ng.groups.creation.live_groups`); repeats, ``None`` and
            groups this rank is not in are skipped; a group serving several kinds counts once.
        kinds: only the groups whose ``group_desc`` names one of these kinds (``A+B`` names both).
        timeout: seconds to wait for the other ranks (every rank passes the same ``kinds``).

    Returns:
        This rank's :class:`SleepReport`, one outcome per group.

    Raises:
        ParallelConfigTimeoutError: some rank did not call within ``timeout`` (named); nothing
            was put to sleep.
        ParallelConfigMismatchError: ranks passed different ``kinds``, or some called
            :func:`wake` instead.
        TypeError, ValueError: bad arguments (named, with the value), before any agreement.
    """
    groups, kinds = _checked(groups, kinds, timeout)
    _prune()
    selected = _selected(groups, kinds)
    result = _agree("sleep", kinds, timeout)
    report = SleepReport("sleep", agreement=result)
    for group in selected:
        report.groups.append(_sleep_one(group))
    if _asleep:
        _patch()
    return report


def wake(
    groups: Iterable[Any] | None = None,
    *,
    kinds: Iterable[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> SleepReport:
    """Wake ``groups`` on this rank, once every rank of the world calls it too.

    The same arguments and errors as :func:`sleep`; a group that is awake is reported skipped.
    After it, each group is the very same object, with its backends, ranks, timeout and
    ``group_desc`` as before the sleep.
    """
    groups, kinds = _checked(groups, kinds, timeout)
    _prune()
    if groups is None:
        groups = [state.group for state in _asleep.values()]
    selected = _selected(groups, kinds)
    result = _agree("wake", kinds, timeout)
    report = SleepReport("wake", agreement=result)
    for group in selected:
        report.groups.append(_wake_one(group))
    if not _asleep:
        _unpatch()
    return report


@contextmanager
def asleep(
    groups: Iterable[Any] | None = None,
    *,
    kinds: Iterable[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Iterator[SleepReport]:
    """``sleep(...)`` on entry, ``wake(...)`` on exit (also on error) of the groups it put to sleep.

    Groups that already slept on entry stay asleep. Every rank enters and leaves together.
    """
    groups, kinds = _checked(groups, kinds, timeout)
    selected = _selected(groups, kinds)
    report = sleep(selected, kinds=kinds, timeout=timeout)
    slept = [g for g, outcome in zip(selected, report.groups, strict=True) if outcome.mechanism != "skipped"]
    try:
        yield report
    finally:
        wake(slept, kinds=kinds, timeout=timeout)
