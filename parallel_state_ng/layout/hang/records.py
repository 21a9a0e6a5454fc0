"""What a rank did on its groups: one :class:`OpRecord` per operation, one :class:`RankRecord` per rank.

A record is the common shape of every source the diagnosis reads: torch's flight-recorder
entries (NCCL, gloo), and the live watcher's own positions
(:mod:`parallel_state_ng.groups.hang_watch`). Sequence numbers count per group and per rank,
as torch counts them: the n-th collective a rank issues on a group has ``seq`` n (p2p
operations count apart, ``p2p=True``). Pure data with checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["STATES", "OpRecord", "RankRecord"]

#: The states of an operation: issued, running, done (torch's flight-recorder names).
STATES = ("scheduled", "started", "completed")


def _check_rank(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a rank (int >= 0), got {value!r}")
    return value


@dataclass(frozen=True)
class OpRecord:
    """One operation a rank issued on one group.

    Args:
        group: the group's name as torch names it (``"3"``), unique within a job.
        desc: the group's ``group_desc`` (the kinds table's description of its kind, or ``A+B`` when
            shared); ``""`` when unknown.
        op: the operation (``"all_reduce"``, ``"send"``, ``"recv"``, ...).
        seq: its sequence number on the group (collectives and p2p counted apart, from 1).
        state: one of :data:`STATES`.
        p2p: whether it is a point-to-point operation.
        peer: for p2p, the global rank of the other side, when known.
        ranks: the group's members (global ranks, in group order), when the source knows them.
        sizes: the input sizes, when known (two ranks at one seq with other sizes: a mismatch).
        time_ns: when it was issued (wall clock, ns), when known: the earliest wait on a
            culprit names the group it failed to enter first.
    """

    group: str
    desc: str
    op: str
    seq: int
    state: str = "scheduled"
    p2p: bool = False
    peer: int | None = None
    ranks: tuple[int, ...] | None = None
    sizes: tuple[tuple[int, ...], ...] | None = None
    time_ns: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not self.group:
            raise ValueError(f"group must be a non-empty str, got {self.group!r}")
        if not isinstance(self.desc, str):
            raise ValueError(f"desc must be a str, got {self.desc!r}")
        if not isinstance(self.op, str) or not self.op:
            raise ValueError(f"op must be a non-empty str, got {self.op!r}")
        if not isinstance(self.seq, int) or isinstance(self.seq, bool) or self.seq < 0:
            raise ValueError(f"seq must be an int >= 0, got {self.seq!r}")
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")
        if self.peer is not None:
            _check_rank(self.peer, "peer")
        if self.ranks is not None:
            for r in self.ranks:
                _check_rank(r, "ranks entry")

    @property
    def done(self) -> bool:
        """Whether the operation completed."""
        return self.state == "completed"

    def label(self) -> str:
        """``all_reduce #3`` (p2p: ``send to 5 #2``)."""
        if self.p2p and self.peer is not None:
            way = "to" if self.op == "send" else "from"
            return f"{self.op} {way} {self.peer} #{self.seq}"
        return f"{self.op} #{self.seq}"


@dataclass(frozen=True)
class RankRecord:
    """Everything one rank reported: its operations in the order issued, and a note.

    Args:
        rank: the global rank.
        ops: its operations, oldest first (a flight recorder's ring may have lost the oldest).
        note: what the rank says it does outside collectives (``"sleeping in the data loader"``),
            or ``""``.
    """

    rank: int
    ops: Sequence[OpRecord] = field(default_factory=tuple)
    note: str = ""

    def __post_init__(self) -> None:
        _check_rank(self.rank, "rank")
        object.__setattr__(self, "ops", tuple(self.ops))
        for op in self.ops:
            if not isinstance(op, OpRecord):
                raise ValueError(f"ops must hold OpRecord entries, got {op!r}")

    @property
    def current(self) -> OpRecord | None:
        """The operation the rank is blocked in: its oldest one not completed (``None``: in no collective)."""
        return next((op for op in self.ops if not op.done), None)

    @property
    def last(self) -> OpRecord | None:
        """Its last completed operation, or ``None``."""
        return next((op for op in reversed(self.ops) if op.done), None)

    def reached(self, group: str, p2p: bool) -> int:
        """The highest sequence number the rank issued on ``group`` (collectives or p2p), 0 if none."""
        return max((op.seq for op in self.ops if op.group == group and op.p2p == p2p), default=0)

    def at(self, group: str, seq: int, p2p: bool = False) -> OpRecord | None:
        """Its operation on ``group`` with sequence number ``seq``, if recorded."""
        return next((op for op in self.ops if op.group == group and op.seq == seq and op.p2p == p2p), None)
