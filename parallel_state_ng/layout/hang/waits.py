"""The chain of waits: which rank each blocked rank waits for, and where the chain ends.

A rank blocked in a collective (its oldest operation not completed, sequence number ``s`` on
group ``G``) waits for every member of ``G`` that has not issued its ``s``-th collective on
``G``, or issued it behind an operation of its own that is blocked (NCCL queues operations
and the CPU goes on); a member that issued another operation at ``s`` (another op, or other
sizes) is a mismatch. A rank blocked in a p2p operation waits for its peer unless the peer is blocked in
the matching operation on the same group. Following the waits from any blocked rank ends at a
rank that waits for nobody: in no collective (a data loader, a sleep, a stuck kernel), one
that did not report (dead, or hung hard), or one that issued the odd operation out. That rank
is the culprit. The *stuck group* is the group that waits on it directly and whose operation
was issued first (the first one the culprit failed to enter); the *chain* shown is the longest
one that ends there, the clearest account of how the rest of the job came to stop.
Placement of each group comes from :class:`~parallel_state_ng.layout.hang.place.Placer`, only
for the ranks and groups involved.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from parallel_state_ng.layout.hang.place import GroupPlace, Placer
from parallel_state_ng.layout.hang.records import OpRecord, RankRecord

__all__ = ["Wait", "Diagnosis", "diagnose"]


@dataclass(frozen=True)
class Wait:
    """One blocked rank: its operation, the group's place, and whom it waits for.

    ``missing``: members that did not arrive; ``mismatched``: members that issued another
    operation at the same sequence number.
    """

    rank: int
    op: OpRecord
    place: GroupPlace
    missing: tuple[int, ...]
    mismatched: tuple[int, ...]

    @property
    def on(self) -> tuple[int, ...]:
        """Every rank this one waits for."""
        return self.missing + self.mismatched


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found.

    Attributes:
        records: every rank's record (as given).
        waits: each blocked rank's :class:`Wait` (only ranks that wait for someone).
        culprits: the ends of the chains, the likely culprit first.
        reasons: each culprit's reason (``in no collective``, ``did not report``, ``issued ...``).
        stuck: the wait on the likely culprit whose operation was issued first, or ``None``.
        chain: the longest chain of waits that ends at the likely culprit (first waiter first).
        cycle: ranks that wait on each other in a cycle with no culprit outside it (a deadlock).
    """

    records: Mapping[int, RankRecord]
    waits: Mapping[int, Wait]
    culprits: tuple[int, ...]
    reasons: Mapping[int, str]
    stuck: Wait | None
    chain: tuple[Wait, ...]
    cycle: tuple[int, ...] = ()

    @property
    def culprit(self) -> int | None:
        """The likely culprit, or ``None`` (no rank waits, or a cycle)."""
        return self.culprits[0] if self.culprits else None


def _index(records: Iterable[RankRecord]) -> dict[int, RankRecord]:
    out: dict[int, RankRecord] = {}
    for rec in records:
        if not isinstance(rec, RankRecord):
            raise ValueError(f"records must be RankRecord entries, got {rec!r}")
        if rec.rank in out:
            raise ValueError(f"records: rank {rec.rank} appears twice")
        out[rec.rank] = rec
    return out


def _matches(op: OpRecord, other: OpRecord | None, rank: int) -> bool:
    """Whether ``other`` (the peer's current operation) is the other side of p2p ``op`` on ``rank``."""
    if other is None or not other.p2p or other.group != op.group:
        return False
    return other.op != op.op and (other.peer is None or other.peer == rank)


def _wait_of(rank: int, op: OpRecord, place: GroupPlace, by_rank: Mapping[int, RankRecord]) -> Wait:
    missing: list[int] = []
    mismatched: list[int] = []
    if op.p2p:
        if op.peer is not None and op.peer != rank:
            peer = by_rank.get(op.peer)
            if peer is None or not _matches(op, peer.current, rank):
                missing.append(op.peer)
        return Wait(rank, op, place, tuple(missing), ())
    for member in place.ranks or ():
        if member == rank:
            continue
        rec = by_rank.get(member)
        if rec is None or rec.reached(op.group, False) < op.seq:
            missing.append(member)
            continue
        other = rec.at(op.group, op.seq)
        if other is not None and not other.done and other is not rec.current:
            missing.append(member)  # issued, but queued behind the member's own blocked operation (NCCL)
        elif other is not None and (other.op != op.op or (op.sizes and other.sizes and other.sizes != op.sizes)):
            mismatched.append(member)
    return Wait(rank, op, place, tuple(missing), tuple(mismatched))


def _odd_ones(wait: Wait, by_rank: Mapping[int, RankRecord]) -> dict[int, str]:
    """At a mismatch, the ranks whose operation differs from the most common one, with a reason."""
    issued: dict[int, OpRecord] = {wait.rank: wait.op}
    for member in wait.mismatched:
        other = by_rank[member].at(wait.op.group, wait.op.seq)
        if other is not None:
            issued[member] = other
    for member in wait.place.ranks or ():
        rec = by_rank.get(member)
        other = rec.at(wait.op.group, wait.op.seq) if rec is not None else None
        if other is not None:
            issued.setdefault(member, other)

    def key(op: OpRecord) -> tuple[str, tuple]:
        return op.op, op.sizes or ()

    counts = Counter(key(op) for op in issued.values())
    # a tie (two members) is broken by the other groups of the same description at the same step
    votes: Counter[tuple[str, tuple]] = Counter()
    for rec in by_rank.values():
        for op in rec.ops:
            if op.desc == wait.op.desc and op.seq == wait.op.seq and not op.p2p and op.group != wait.op.group:
                votes[key(op)] += 1
    common = max(counts, key=lambda k: (counts[k], votes[k], -min(r for r, op in issued.items() if key(op) == k)))
    expected = next(op for op in issued.values() if key(op) == common)
    return {
        r: f"issued {op.op} #{op.seq}{_sizes(op)} where its peers issued {expected.op}{_sizes(expected)}"
        for r, op in sorted(issued.items())
        if key(op) != common
    }


def _sizes(op: OpRecord) -> str:
    return f" {[list(s) for s in op.sizes]}" if op.sizes else ""


def diagnose(records: Iterable[RankRecord], placer: Placer | None = None) -> Diagnosis:
    """Follow the waits of ``records`` (one :class:`RankRecord` per reporting rank) to the culprit.

    Args:
        records: what each rank reported; ranks a group needs but that did not report count
            as ``did not report``.
        placer: places groups in the layout (default: kinds from descriptions only).

    Raises:
        ValueError: ``records`` holds something else than :class:`RankRecord`, or a rank twice.
    """
    by_rank = _index(records)
    placer = placer if placer is not None else Placer(None)
    waits: dict[int, Wait] = {}
    reasons: dict[int, str] = {}
    for rank, rec in sorted(by_rank.items()):
        op = rec.current
        if op is None:
            continue
        wait = _wait_of(rank, op, placer.place(op.group, op.desc, rank, op.ranks), by_rank)
        if wait.on:
            waits[rank] = wait
        if wait.mismatched:
            reasons.update(_odd_ones(wait, by_rank))
    for wait in waits.values():
        for member in wait.missing:
            if member in reasons or member in waits:
                continue
            found = by_rank.get(member)
            if found is None:
                reasons[member] = "did not report"
            elif found.current is None:
                reasons[member] = "in no collective" + (f" ({found.note})" if found.note else "")
    # the odd one out at a mismatch waits too, but its wait is not why the others stop
    for rank in list(waits):
        if rank in reasons:
            del waits[rank]
    return _conclude(by_rank, waits, reasons)


def _steps_after(rec: RankRecord, anchor: OpRecord | None, op: OpRecord) -> int:
    """How many operations ``rec`` issued between its twin of ``anchor`` and ``op`` (large: no twin).

    Ranks run one program: the twin is the operation with ``anchor``'s description, sequence
    number and kind (collective or p2p), on the rank's own group of that kind. The wait with
    the fewest operations since the culprit's last one is the one the culprit failed to enter
    first; wall-clock issue times across processes come second.
    """
    if anchor is None:
        return len(rec.ops)
    ops = list(rec.ops)
    end = next((i for i, o in enumerate(ops) if o is op), len(ops))
    for i in range(end - 1, -1, -1):
        twin = ops[i]
        if twin.desc == anchor.desc and twin.seq == anchor.seq and twin.p2p == anchor.p2p and twin.op == anchor.op:
            return end - i - 1
    return len(ops)


def _conclude(by_rank: Mapping[int, RankRecord], waits: dict[int, Wait], reasons: dict[int, str]) -> Diagnosis:
    chains: dict[int, tuple[Wait, ...] | None] = {}

    def chain_from(rank: int, seen: tuple[int, ...]) -> tuple[Wait, ...] | None:
        """The longest chain of waits from ``rank`` to a culprit (``None``: only cycles)."""
        if rank in chains:
            return chains[rank]
        best: tuple[Wait, ...] | None = None
        wait = waits[rank]
        for nxt in sorted(set(wait.on)):
            if nxt in reasons:
                found: tuple[Wait, ...] | None = (wait,)
            elif nxt in waits and nxt not in seen:
                rest = chain_from(nxt, (*seen, nxt))
                found = None if rest is None else (wait, *rest)
            else:
                found = None
            if found is not None and (best is None or len(found) > len(best)):
                best = found
        chains[rank] = best
        return best

    ends: Counter[int] = Counter()
    for rank in sorted(waits):
        found = chain_from(rank, (rank,))
        if found is not None:
            ends[next(r for r in sorted(set(found[-1].on)) if r in reasons)] += 1
    if not ends:
        cycle = tuple(sorted(waits))
        return Diagnosis(by_rank, waits, (), {}, None, (), cycle)
    # the likely culprit: the one most blocked ranks lead to (ties: the lowest rank)
    culprits = tuple(sorted(ends, key=lambda r: (-ends[r], r)))
    culprit = culprits[0]
    direct = [w for w in waits.values() if culprit in w.on]
    anchor = by_rank[culprit].last if culprit in by_rank else None
    stuck = min(direct, key=lambda w: (_steps_after(by_rank[w.rank], anchor, w.op), w.op.time_ns or 0, w.rank))
    candidates = [c for c in (chains.get(r) for r in sorted(waits)) if c and culprit in c[-1].on]
    chain = max(candidates, key=len) if candidates else (stuck,)
    return Diagnosis(by_rank, waits, culprits, {r: reasons[r] for r in culprits}, stuck, chain)
