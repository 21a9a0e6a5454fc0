"""What changes between two layout snapshots, kind by kind (``layout --check`` and ``layout --diff``).

:func:`diff_snapshots` compares two snapshots (:mod:`parallel_state_ng.layout.snapshot`): per
group kind, whether it appears or vanishes, which groups are added or removed (groups compared
as ordered rank lists: MCore's in-group order is a rank's position; the order of the groups
does not count, as MCore creates some derived kinds in another order), which ranks change group,
and changes of ``group_desc``, timeout rule and gloo twin; then the communicators per rank
(:func:`communicators_per_rank`: one per group a rank is in, plus its gloo twin, as
``initialize_model_parallel`` creates them by default without group sharing). The result is
data (:class:`LayoutDiff`, :meth:`LayoutDiff.as_json`); the tool writes it for people. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["KindChange", "RankMove", "LayoutDiff", "diff_snapshots", "communicators_per_rank", "DIFF_SCHEMA"]

#: The schema of :meth:`LayoutDiff.as_json`.
DIFF_SCHEMA = "parallel_state_ng.layout-diff/1"


@dataclass(frozen=True)
class RankMove:
    """A rank whose group of a kind changes (``None``: in no group of the kind on that side)."""

    rank: int
    old: list[int] | None
    new: list[int] | None


@dataclass
class KindChange:
    """How one group kind differs: ``status`` ``"added"`` / ``"removed"`` (the kind exists on one
    side only) or ``"changed"``; ``desc``, ``timeout`` and ``gloo`` are (old, new) pairs when they
    differ; ``removed`` / ``added`` the groups on one side only; ``moved`` the ranks whose group
    changes.
    """

    kind: str
    status: Literal["added", "removed", "changed"]
    desc: tuple[str, str] | None = None
    timeout: tuple[str, str] | None = None
    flipped_by: str | None = None
    gloo: tuple[Any, Any] | None = None
    removed: list[list[int]] = field(default_factory=list)
    added: list[list[int]] = field(default_factory=list)
    moved: list[RankMove] = field(default_factory=list)
    entry: Mapping[str, Any] | None = None  # the kind's entry on its side (added / removed kinds)
    new_desc: str = ""  # a changed kind's group_desc on the new side

    def as_json(self) -> dict[str, Any]:
        """JSON-ready data of the change."""
        out: dict[str, Any] = {"status": self.status}
        if self.entry is not None:
            out.update(
                desc=self.entry["desc"],
                timeout=self.entry["timeout"]["rule"],
                num_groups=len(self.entry["groups"]),
                groups=sorted(self.entry["groups"]),
            )
            return out
        for name in ("desc", "timeout", "gloo"):
            pair = getattr(self, name)
            if pair is not None:
                out[name] = {"old": pair[0], "new": pair[1]}
        if self.timeout is not None:
            out["timeout"]["flipped_by"] = self.flipped_by
        if self.removed or self.added:
            out["groups_removed"] = self.removed
            out["groups_added"] = self.added
            out["ranks_moved"] = [{"rank": m.rank, "old": m.old, "new": m.new} for m in self.moved]
        return out


@dataclass
class LayoutDiff:
    """Two snapshots' differences: the changed kinds (in the new side's creation order, vanished
    kinds where they were on the old side), the unchanged ones, the communicators per rank on
    each side and the configurations.
    """

    old_label: str
    new_label: str
    old_config: Mapping[str, Any]
    new_config: Mapping[str, Any]
    old_release: str
    new_release: str
    changes: list[KindChange]
    unchanged: list[str]
    old_communicators: list[int]
    new_communicators: list[int]

    @property
    def same(self) -> bool:
        """Whether the two snapshots hold the same layout (and the same communicator counts)."""
        return not self.changes and self.old_communicators == self.new_communicators

    def communicator_changes(self) -> list[tuple[int, int | None, int | None]]:
        """(rank, old count, new count) for every rank whose communicator count changes."""
        old, new = self.old_communicators, self.new_communicators
        out: list[tuple[int, int | None, int | None]] = []
        for rank in range(max(len(old), len(new))):
            a = old[rank] if rank < len(old) else None
            b = new[rank] if rank < len(new) else None
            if a != b:
                out.append((rank, a, b))
        return out

    def as_json(self) -> dict[str, Any]:
        """JSON-ready data of the whole diff (schema :data:`DIFF_SCHEMA`)."""
        return {
            "schema": DIFF_SCHEMA,
            "old": {"label": self.old_label, "release": self.old_release, "config": dict(self.old_config)},
            "new": {"label": self.new_label, "release": self.new_release, "config": dict(self.new_config)},
            "same": self.same,
            "kinds": {c.kind: c.as_json() for c in self.changes},
            "unchanged": self.unchanged,
            "communicators": {
                "old": _span(self.old_communicators),
                "new": _span(self.new_communicators),
                "ranks_changed": [{"rank": r, "old": a, "new": b} for r, a, b in self.communicator_changes()],
            },
        }


def _span(counts: list[int]) -> dict[str, int]:
    return {"min": min(counts, default=0), "max": max(counts, default=0)}


def communicators_per_rank(snapshot: Mapping[str, Any]) -> list[int]:
    """Communicators each rank gets: one per group it is in, plus the group's gloo twin if any.

    As ``initialize_model_parallel`` creates them with its defaults (gloo twins on, no group
    sharing); the all-gather and hybrid groups, built on request, are not counted.
    """
    counts = [0] * snapshot["config"]["world_size"]
    for entry in snapshot["kinds"].values():
        per_group = 2 if entry["gloo"] is not None else 1
        for group in entry["groups"]:
            for rank in group:
                counts[rank] += per_group
    return counts


def _kind_change(kind: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> KindChange | None:
    change = KindChange(kind, "changed", new_desc=new["desc"])
    if old["desc"] != new["desc"]:
        change.desc = (old["desc"], new["desc"])
    if old["timeout"]["rule"] != new["timeout"]["rule"]:
        change.timeout = (old["timeout"]["rule"], new["timeout"]["rule"])
        change.flipped_by = new["timeout"].get("flipped_by") or old["timeout"].get("flipped_by")
    if old["gloo"] != new["gloo"]:
        change.gloo = (old["gloo"], new["gloo"])
    old_groups = {tuple(g) for g in old["groups"]}
    new_groups = {tuple(g) for g in new["groups"]}
    change.removed = sorted(list(g) for g in old_groups - new_groups)
    change.added = sorted(list(g) for g in new_groups - old_groups)
    if change.removed or change.added:
        before = {r: g for g in change.removed for r in g}
        after = {r: g for g in change.added for r in g}
        change.moved = [RankMove(r, before.get(r), after.get(r)) for r in sorted(set(before) | set(after))]
    if change.desc is None and change.timeout is None and change.gloo is None and not change.moved:
        return None
    return change


def _merged_order(old: list[str], new: list[str]) -> list[str]:
    """``new``'s kinds in their order, each kind only in ``old`` right after its predecessor there."""
    order = list(new)
    for i, kind in enumerate(old):
        if kind not in order:
            order.insert(order.index(old[i - 1]) + 1 if i else 0, kind)
    return order


def diff_snapshots(
    old: Mapping[str, Any], new: Mapping[str, Any], old_label: str = "old", new_label: str = "new"
) -> LayoutDiff:
    """What changes from snapshot ``old`` to snapshot ``new`` (both validated snapshots)."""
    old_kinds, new_kinds = old["kinds"], new["kinds"]
    order = _merged_order(list(old_kinds), list(new_kinds))
    changes: list[KindChange] = []
    unchanged: list[str] = []
    for kind in order:
        if kind not in new_kinds:
            changes.append(KindChange(kind, "removed", entry=old_kinds[kind]))
        elif kind not in old_kinds:
            changes.append(KindChange(kind, "added", entry=new_kinds[kind]))
        else:
            change = _kind_change(kind, old_kinds[kind], new_kinds[kind])
            if change is None:
                unchanged.append(kind)
            else:
                changes.append(change)
    return LayoutDiff(
        old_label=old_label,
        new_label=new_label,
        old_config=old["config"],
        new_config=new["config"],
        old_release=old["release"],
        new_release=new["release"],
        changes=changes,
        unchanged=unchanged,
        old_communicators=communicators_per_rank(old),
        new_communicators=communicators_per_rank(new),
    )
