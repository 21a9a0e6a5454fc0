"""What :func:`~parallel_state_ng.builders.verify.verify_groups` finds: traps, findings, reports.

:data:`TRAPS` names every way a held group can differ from MCore's layout; a :class:`Mismatch`
is one finding on one rank, :class:`RankCheck` one rank's local result and
:class:`VerifyReport` the result every rank receives (:meth:`VerifyReport.render` gives the
text). Data only: no collective, no group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TRAPS", "Mismatch", "RankCheck", "VerifyReport", "ranks_text"]

#: Every trap a finding can name -> what it means.
TRAPS: dict[str, str] = {
    "none": "the value is None where MCore's layout has a group",
    "missing": "the field or global is not there at all where MCore's layout has a group",
    "whole_world": "the value is the whole world (WORLD, or a group of every rank) where a sub-group belongs",
    "other_layout": "the value's ranks are not this layout's group of the kind for this rank",
    "unexpected": "the value is a group where MCore's layout has none for this rank",
    "not_member": "the value is a group this rank is not in (NON_GROUP_MEMBER, rank -1)",
}
_SHOWN = 8  # ranks shown of a long group


def ranks_text(ranks: tuple[int, ...] | None) -> str:
    """``ranks`` as shown in a finding: a long group shortened to its first ranks."""
    if ranks is None:
        return "None"
    if len(ranks) <= _SHOWN:
        return str(list(ranks))
    return f"[{', '.join(map(str, ranks[:_SHOWN]))}, ... ({len(ranks)} ranks)]"


@dataclass(frozen=True)
class Mismatch:
    """One finding: on ``rank``, ``where`` (a field, global or dim) holds the wrong thing.

    ``trap`` is a key of :data:`TRAPS`; ``expected`` / ``found`` the members (``None``: no
    group); ``note`` which layout the found group fits, where that was cheap to tell.
    """

    rank: int
    where: str
    kind: str
    trap: str
    expected: tuple[int, ...] | None
    found: tuple[int, ...] | None
    note: str = ""

    def message(self) -> str:
        """One line saying what is wrong."""
        exp, got = ranks_text(self.expected), ranks_text(self.found)
        head = f"rank {self.rank}: {self.where} (kind {self.kind!r})"
        text = {
            "none": f"{head} is None, but MCore's layout puts the rank in group {exp}",
            "missing": f"{head} is missing (not set), but MCore's layout puts the rank in group {exp}",
            "whole_world": (
                f"{head} holds the whole world {got} instead of group {exp}: whatever reduces over it "
                f"reduces over every rank (Megatron falls back to the world when mp is None; the grad "
                f"norm came out sqrt(2) too large)"
            ),
            "other_layout": f"{head} holds group {got}, but this layout's group for the rank is {exp}",
            "unexpected": f"{head} holds group {got}, but MCore's layout has no such group for the rank (None)",
            "not_member": f"{head} holds a group the rank is not in (MCore's layout puts it in {exp})",
        }[self.trap]
        return f"{text}; {self.note}" if self.note else text


@dataclass
class RankCheck:
    """One rank's local result: its findings, how many entries it checked, which it could not."""

    rank: int
    source: str
    mismatches: list[Mismatch]
    checked: int
    unchecked: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    """The result of :func:`verify_groups`, the same on every rank.

    ``ok``: no mismatch on any rank. ``mismatches``: every finding of every rank, by rank.
    ``checked``: entries compared over all ranks; ``unchecked``: names some rank holds that no
    group kind describes (0.18+'s all-gather fields). :meth:`render` gives the text.
    """

    ok: bool
    mismatches: list[Mismatch]
    source: str
    release: str
    config: dict[str, Any]
    world_size: int
    checked: int
    unchecked: list[str] = field(default_factory=list)

    def traps(self) -> dict[str, int]:
        """Trap -> number of findings."""
        out: dict[str, int] = {}
        for m in self.mismatches:
            out[m.trap] = out.get(m.trap, 0) + 1
        return out

    def render(self) -> str:
        """The full report as text: a summary line, then one line per finding."""
        stated = ", ".join(f"{k}={v}" for k, v in sorted(self.config.items())) or "defaults"
        ranks = len({m.rank for m in self.mismatches})
        head = (
            f"verify_groups: {self.source} against megatron-core {self.release}'s layout ({stated}; "
            f"{self.world_size} ranks): "
        )
        if self.ok:
            lines = [head + f"ok, {self.checked} groups checked"]
        else:
            lines = [head + f"{len(self.mismatches)} mismatch(es) on {ranks} rank(s), {self.checked} groups checked"]
            lines += ["  " + m.message() for m in self.mismatches]
        if self.unchecked:
            lines.append(f"  not checked (no group kind behind them): {', '.join(self.unchecked)}")
        return "\n".join(lines)
