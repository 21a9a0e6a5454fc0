"""A :class:`~parallel_state_ng.layout.hang.waits.Diagnosis` as text: the culprit first.

The first line names the likely culprit (rank, coordinates, why), the stuck group's kinds,
coordinates and ranks, and the operation it stalled at; then the ranks that did not arrive
and what each was doing instead; then the chain of waits in one sentence; then every blocked
rank, one line each (cut after :data:`MAX_LISTED`).
"""

from __future__ import annotations

from parallel_state_ng.layout.hang.place import Placer
from parallel_state_ng.layout.hang.records import RankRecord
from parallel_state_ng.layout.hang.waits import Diagnosis, Wait

__all__ = ["MAX_LISTED", "render", "doing"]

#: Blocked ranks listed one per line before the rest is counted.
MAX_LISTED = 16


def _who(rank: int, placer: Placer) -> str:
    coords = placer.rank_coords(rank)
    return f"rank {rank} ({coords})" if coords else f"rank {rank}"


def doing(rec: RankRecord | None, diagnosis: Diagnosis, placer: Placer) -> str:
    """What a rank was doing: its current operation and group kind, or why it is in none."""
    if rec is None:
        return "did not report"
    op = rec.current
    if op is None:
        last = rec.last
        tail = ""
        if last is not None:
            tail = f"; last: {last.label()} on {placer.place(last.group, last.desc, rec.rank, last.ranks).kind_names}"
        note = f" ({rec.note})" if rec.note else ""
        return f"in no collective{note}{tail}"
    wait = diagnosis.waits.get(rec.rank)
    kinds = wait.place.kind_names if wait else placer.place(op.group, op.desc, rec.rank, op.ranks).kind_names
    on = f", waiting for {_ranks(wait.on)}" if wait else ""
    return f"in {op.label()} on {kinds}{on}"


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _link(wait: Wait) -> str:
    return f"rank {wait.rank} waits in {wait.place.kind_names} on {_ranks(wait.on)}"


def render(diagnosis: Diagnosis, placer: Placer | None = None) -> str:
    """The report of ``diagnosis`` (``placer``: the one the diagnosis used, for coordinates)."""
    placer = placer if placer is not None else Placer(None)
    lines: list[str] = []
    culprit, stuck = diagnosis.culprit, diagnosis.stuck
    if culprit is None or stuck is None:
        if diagnosis.cycle:
            lines.append(f"hang: no culprit outside a cycle of waits among {_ranks(diagnosis.cycle)} (a deadlock)")
        else:
            lines.append("hang: no rank waits for another (nothing is stuck in a collective)")
    else:
        lines.append(
            f"hang: likely culprit {_who(culprit, placer)}, {diagnosis.reasons[culprit]}; "
            f"stuck group {stuck.place.text()} at {stuck.op.label()}"
        )
        for rank in stuck.on:
            what = doing(diagnosis.records.get(rank), diagnosis, placer)
            lines.append(f"  did not arrive: {_who(rank, placer)}: {what}")
        sentence = "; ".join(_link(w) for w in diagnosis.chain)
        lines.append(f"chain of waits: {sentence}; rank {culprit} is {diagnosis.reasons[culprit]}")
        for other in diagnosis.culprits[1:]:
            lines.append(f"also at the end of a chain: {_who(other, placer)}, {diagnosis.reasons[other]}")
    waits = sorted(diagnosis.waits.values(), key=lambda w: w.rank)
    if waits:
        lines.append(f"blocked ranks ({len(waits)}):")
        for wait in waits[:MAX_LISTED]:
            lines.append(f"  rank {wait.rank}: {wait.op.label()} on {wait.place.text()}, waiting for {_ranks(wait.on)}")
        if len(waits) > MAX_LISTED:
            lines.append(f"  ... and {len(waits) - MAX_LISTED} more")
    return "\n".join(lines)
