"""Live hang reports: a collective on a project group past a bound names its culprit, once.

:func:`watch_hangs` (or :class:`HangWatch`) records, on every rank, each operation issued on a
group the project created (``torch.distributed`` collectives and p2p, by group: torch's name,
``group_desc``, members, per-group sequence number, issue time, and the ``Work`` when the call
returns one). A watcher thread retires ``Work`` objects that completed and checks the rank's
oldest unfinished operation against the bound. The first rank past the bound raises the alarm
in the world's store; every rank that can still answer posts its position (its recent
operations, in the flight recorder's format) and the first rank to raise the alarm gathers the
positions for up to ``gather_s``, diagnoses them against the layout
(:func:`~parallel_state_ng.layout.hang.diagnose`) and prints one report (``on_report``).

Why our own records and not torch's flight recorder (considered first, since it costs us
nothing per collective): in torch 2.13 it records nothing on gloo for ``send``/``recv`` and
leaves ``pg_config`` (the members) empty, so on gloo it cannot see a rank blocked in a
pipeline receive, the very link that makes a chain of waits; it must also be switched on by an
environment variable before the groups exist, and its recording is torch's, not ours, to keep.
Offline, torch's own dumps are read as they are (:mod:`parallel_state_ng.layout.hang.flight_recorder`);
live, the watch's records cover both backends alike. What the normal path pays: one dict
lookup for the group, a counter, a small slot appended to a bounded ring and a clock read per
operation on a project group (nothing on other groups beyond the lookup); no store traffic and
no synchronisation until the bound is passed. ``python -m scripts.bench hang_watch`` measures
it (docs/results/performance.md). The watcher thread polls, every ``poll_s``, each unfinished ``Work``
(``is_completed``) and one store key.

Scope: calls through ``torch.distributed.<function>`` (how Megatron-Core calls them); a name
imported from ``torch.distributed`` before :meth:`HangWatch.start` is not seen. ``P2POp`` is
served so that it accepts the recorded ``isend``/``irecv``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.creation import is_tracked
from parallel_state_ng.layout.hang import Diagnosis, OpRecord, Placer, RankRecord, diagnose, render
from parallel_state_ng.layout.hang.flight_recorder import record_of_dump, records_dump
from parallel_state_ng.layout.megatron_layout import MegatronLayout

__all__ = ["HangWatch", "watch_hangs", "COLLECTIVES", "P2P"]

#: The collectives recorded: ``torch.distributed`` name -> the operation's name in a report.
COLLECTIVES: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
}
#: The p2p functions recorded, and the side each is.
P2P: dict[str, str] = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}

_active: list[HangWatch] = []
_generation = [0]


# A recorded operation is a list (cheaper to make than an object on the path of every collective):
# [group info, op, seq, p2p, peer, issue time (ns), Work or None, done]
_INFO, _OP, _SEQ, _P2P, _PEER, _TIME, _WORK, _DONE = range(8)
_UNSEEN: Any = object()


def _op_record(slot: list) -> OpRecord:
    info = slot[_INFO]
    return OpRecord(
        group=info[1],
        desc=info[2],
        op=slot[_OP],
        seq=slot[_SEQ],
        state="completed" if slot[_DONE] else "started",
        p2p=slot[_P2P],
        peer=slot[_PEER],
        ranks=info[3],
        time_ns=slot[_TIME],
    )


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


class HangWatch:
    """One rank's hang watch (start it on every rank, after the groups exist).

    Args:
        bound_s: seconds an operation may run before the watch reports (well below the
            watchdog's timeout).
        layout: the job's layout, for the report's kinds and coordinates; ``{name: layout}`` for
            several in one process (the registry's layouts: the report names which); ``None``:
            kinds from the descriptions only.
        poll_s: how often the watcher thread looks (default: a quarter of ``bound_s``, at most 1 s).
        gather_s: how long the reporting rank waits for positions (default ``bound_s``).
        on_report: called once, on the reporting rank, with the report's text (default: printed
            to stderr).
        dump_dir: when given, every rank that answers writes its records there in the flight
            recorder's format (``psng_hang_rank_<rank>``), for ``parallel-state-ng diagnose``.
        fr_dump_dir: when given, every rank that answers writes torch's own flight-recorder dump
            there (``fr_trace_rank_<rank>``; empty unless ``TORCH_FR_BUFFER_SIZE`` was set).
        ring: operations kept per rank (the oldest go first).
        only_project: record only groups the project created (``False``: every group but WORLD).
        note: a callable returning what the rank does outside collectives, posted with its position.
    """

    def __init__(
        self,
        bound_s: float,
        *,
        layout: MegatronLayout | Mapping[str, MegatronLayout] | None = None,
        poll_s: float | None = None,
        gather_s: float | None = None,
        on_report: Callable[[str], None] | None = None,
        dump_dir: str | None = None,
        fr_dump_dir: str | None = None,
        ring: int = 256,
        only_project: bool = True,
        note: Callable[[], str] | None = None,
    ) -> None:
        self.bound_s = _positive(bound_s, "bound_s")
        self.poll_s = _positive(poll_s, "poll_s") if poll_s is not None else min(self.bound_s / 4, 1.0)
        self.gather_s = _positive(gather_s, "gather_s") if gather_s is not None else self.bound_s
        if layout is not None and not isinstance(layout, MegatronLayout):
            if not (isinstance(layout, Mapping) and all(isinstance(v, MegatronLayout) for v in layout.values())):
                raise ValueError(
                    f"layout must be a MegatronLayout, a mapping of names to them, or None, got {layout!r}"
                )
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
            raise ValueError(f"ring must be an int >= 1, got {ring!r}")
        for name, value in (("dump_dir", dump_dir), ("fr_dump_dir", fr_dump_dir)):
            if value is not None and not (isinstance(value, str) and os.path.isdir(value)):
                raise ValueError(f"{name} must be an existing directory, got {value!r}")
        if on_report is not None and not callable(on_report):
            raise ValueError(f"on_report must be callable, got {on_report!r}")
        if note is not None and not callable(note):
            raise ValueError(f"note must be callable, got {note!r}")
        self.layout, self.on_report, self.note = layout, on_report, note
        self.dump_dir, self.fr_dump_dir, self.only_project = dump_dir, fr_dump_dir, only_project
        self.slots: deque[list] = deque(maxlen=ring)
        self.report: str | None = None  #: the report's text, on the rank that printed it
        self.diagnosis: Diagnosis | None = None
        self._groups: dict[int, list | None] = {}
        self._saved: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prefix = ""

    # ------------------------------------------------------------------ recording
    def _info(self, group: Any) -> list | None:
        """[group, name, desc, members, collective seq, p2p seq] of a recorded group, else ``None``."""
        key = id(group)
        if key in self._groups:
            found = self._groups[key]
            if found is None or found[0] is group:
                return found
        info = None
        if group is not None and (not self.only_project or is_tracked(group)):
            name = dist.distributed_c10d._get_process_group_name(group)
            desc = getattr(group, "group_desc", "") or ""
            info = [group, name, desc, tuple(dist.get_process_group_ranks(group)), 0, 0]
        self._groups[id(group)] = info
        return info

    def _slot(self, group: Any, op: str, p2p: bool, peer: int | None) -> list | None:
        """A new slot for ``op`` on ``group`` (``None``: the group is not recorded)."""
        info = self._groups.get(id(group), _UNSEEN)
        if info is _UNSEEN or (info is not None and info[0] is not group):
            info = self._info(group)
        if info is None:
            return None
        at = 5 if p2p else 4
        info[at] += 1
        slot = [info, op, info[at], p2p, peer, time.time_ns(), None, False]
        self.slots.append(slot)
        return slot

    def _collective(self, fn: Callable, op: str) -> Callable:
        names = list(inspect.signature(fn).parameters)
        at = names.index("group")
        # a blocking call is made as torch makes it (async, then wait) to keep its Work: on NCCL the
        # wait returns once the kernel is queued, and only the Work tells that it never finished
        async_at = names.index("async_op") if "async_op" in names else None
        groups, append, clock, slow = self._groups, self.slots.append, time.time_ns, self._info

        def recorded(*args: Any, **kwargs: Any) -> Any:
            # the path of every collective: kept to a dict look-up, a counter, a list and a clock
            group = args[at] if len(args) > at else kwargs.get("group")
            info = groups.get(id(group), _UNSEEN)
            if info is _UNSEEN or (info is not None and info[0] is not group):
                info = slow(group)
            if info is None:
                return fn(*args, **kwargs)
            info[4] += 1
            slot = [info, op, info[4], False, None, clock(), None, False]
            append(slot)
            if async_at is None or len(args) > async_at or kwargs.get("async_op"):
                return _finish(slot, fn, args, kwargs)
            kwargs["async_op"] = True
            try:
                work = fn(*args, **kwargs)
                if work is not None:
                    slot[_WORK] = work
                    work.wait()
            except BaseException:
                slot[_DONE], slot[_WORK] = True, None
                raise
            if work is None or work.is_completed():  # gloo, CPU: done; NCCL: the watcher retires it
                slot[_DONE], slot[_WORK] = True, None
            return None

        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        return recorded

    def _p2p(self, fn: Callable, op: str) -> Callable:
        names = list(inspect.signature(fn).parameters)
        at, peer_at, peer_name = names.index("group"), 1, names[1]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            group = args[at] if len(args) > at else kwargs.get("group")
            peer = args[peer_at] if len(args) > peer_at else kwargs.get(peer_name)
            slot = self._slot(group, op, True, peer)
            if slot is None:
                return fn(*args, **kwargs)
            return _finish(slot, fn, args, kwargs)

        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        return recorded

    def _batch(self, fn: Callable) -> Callable:
        def recorded(p2p_op_list: Any) -> Any:
            slots = []
            for item in p2p_op_list:
                side = "send" if getattr(item.op, "__name__", "") == "isend" else "recv"
                slots.append(self._slot(item.group, side, True, item.peer))
            works = fn(p2p_op_list)
            for i, slot in enumerate(slots):
                if slot is not None:
                    slot[_WORK] = works[i] if len(works) == len(slots) else (works[-1] if works else None)
                    slot[_DONE] = slot[_WORK] is None
            return works

        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        return recorded

    # ------------------------------------------------------------------ life
    def start(self) -> HangWatch:
        """Record from now on and start the watcher thread (one watch per process)."""
        if _active:
            raise RuntimeError("a HangWatch is already running in this process; stop it first")
        if not dist.is_initialized():
            raise RuntimeError("HangWatch.start needs an initialized default process group")
        _generation[0] += 1
        self._prefix = f"psng-hang/{_generation[0]}/"
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        patched: dict[str, Any] = {}
        for name, op in COLLECTIVES.items():
            if hasattr(dist, name):
                patched[name] = self._collective(getattr(dist, name), op)
        for name, side in P2P.items():
            patched[name] = self._p2p(getattr(dist, name), side)
        patched["batch_isend_irecv"] = self._batch(dist.batch_isend_irecv)
        patched["P2POp"] = _p2p_op_class(dist.P2POp)
        for name, value in patched.items():
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, value)
        _active.append(self)
        self._thread = threading.Thread(target=self._watch, name="psng-hang-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop recording and the watcher thread; torch's functions are restored."""
        self._stop.set()
        for name, value in self._saved.items():
            setattr(dist, name, value)
        self._saved.clear()
        if self in _active:
            _active.remove(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.gather_s + 2 * self.poll_s))

    def position(self) -> RankRecord:
        """This rank's record now (its recent operations, oldest first)."""
        self._retire()
        note = ""
        if self.note is not None:
            with contextlib.suppress(Exception):
                note = str(self.note())
        return RankRecord(self.rank, tuple(_op_record(s) for s in list(self.slots)), note=note)

    def _retire(self) -> None:
        for slot in list(self.slots):
            if not slot[_DONE] and slot[_WORK] is not None:
                with contextlib.suppress(Exception):
                    if slot[_WORK].is_completed():
                        slot[_DONE], slot[_WORK] = True, None  # no tensor kept alive past its operation

    def _late(self) -> bool:
        self._retire()
        now = time.time_ns()
        oldest = next((s for s in list(self.slots) if not s[_DONE]), None)
        return oldest is not None and now - oldest[_TIME] > self.bound_s * 1e9

    def _watch(self) -> None:
        alarm = self._prefix + "alarm"
        try:
            while not self._stop.wait(self.poll_s):
                raised = self.store.check([alarm])
                if not raised and self._late():
                    first = self.store.add(alarm, 1) == 1
                    self._answer()
                    if first:
                        self._report()
                    return
                if raised:
                    self._answer()
                    return
        except Exception as err:  # the store went away (its host rank died): nothing to report to
            print(f"parallel_state_ng hang watch on rank {self.rank} stopped: {err}", file=sys.stderr)

    def _answer(self) -> None:
        """Post this rank's position to the store (and the dump folders)."""
        dump = records_dump(self.position())
        self.store.set(f"{self._prefix}rank/{self.rank}", json.dumps(dump))
        self.store.add(self._prefix + "answered", 1)
        if self.dump_dir is not None:
            import pickle

            _write(os.path.join(self.dump_dir, f"psng_hang_rank_{self.rank}"), pickle.dumps(dump))
        if self.fr_dump_dir is not None:
            with contextlib.suppress(Exception):
                import torch._C._distributed_c10d as c10d

                trace = c10d._dump_fr_trace(True, False, False)  # type: ignore[attr-defined]
                _write(os.path.join(self.fr_dump_dir, f"fr_trace_rank_{self.rank}"), trace)

    def _report(self) -> None:
        deadline = time.monotonic() + self.gather_s
        while time.monotonic() < deadline and self.store.add(self._prefix + "answered", 0) < self.world_size:
            time.sleep(min(0.05, self.poll_s))
        records = []
        for rank in range(self.world_size):  # the reporting rank only, once
            key = f"{self._prefix}rank/{rank}"
            if self.store.check([key]):
                dump = json.loads(self.store.get(key))
                records.append(record_of_dump(dump, rank, source=f"rank {rank}'s position"))
        placer = Placer(self.layout)
        self.diagnosis = diagnose(records, placer)
        self.report = render(self.diagnosis, placer)
        self.store.set(self._prefix + "report", self.report)
        if self.on_report is not None:
            self.on_report(self.report)
        else:
            print(self.report, file=sys.stderr, flush=True)

    def reported(self) -> bool:
        """Whether a report was made in this watch's world (any rank; one store look-up)."""
        return bool(self._prefix) and self.store.check([self._prefix + "report"])


def _finish(slot: list, fn: Callable, args: tuple, kwargs: dict) -> Any:
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        slot[_DONE] = True
        raise
    if result is not None and hasattr(result, "is_completed"):
        slot[_WORK] = result
    else:
        slot[_DONE] = True
    return result


def _p2p_op_class(base: type) -> type:
    """``P2POp`` that takes the recorded ``isend``/``irecv`` for torch's own."""

    class P2POp(base):
        def __new__(cls, op: Callable, *args: Any, **kwargs: Any) -> Any:
            return base.__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)

        def __init__(self, op: Callable, *args: Any, **kwargs: Any) -> None:
            super().__init__(getattr(op, "__wrapped__", op), *args, **kwargs)

    P2POp.__qualname__ = base.__qualname__
    return P2POp


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def watch_hangs(bound_s: float, **options: Any) -> Iterator[HangWatch]:
    """A :class:`HangWatch` started for the block and stopped after it (options as :class:`HangWatch`)."""
    watch = HangWatch(bound_s, **options).start()
    try:
        yield watch
    finally:
        watch.stop()
