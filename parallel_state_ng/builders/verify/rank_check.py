"""One rank's check: its groups in the source against the ones MCore's layout gives it.

:func:`check_rank_groups` reads the source (:mod:`.sources`), computes the rank's expected groups
for the stated configuration (:mod:`.expected`) and compares entry by entry, naming each
difference by its trap (:data:`~.findings.TRAPS`). No collective: the gathering over all ranks
is :func:`~.job.verify_groups`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from parallel_state_ng.builders.verify.expected import check_config, expected_globals, fit_hint, stated_layout
from parallel_state_ng.builders.verify.findings import Mismatch, RankCheck, ranks_text
from parallel_state_ng.builders.verify.sources import MISSING, Entry, read_source
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.releases import Release, as_release

__all__ = ["check_rank_groups"]


# --------------------------------------------------------------------------- comparing one entry
@dataclass(frozen=True)
class _Outside:
    """A group the rank is not in: its ranks, or ``None`` for torch's ``NON_GROUP_MEMBER``."""

    ranks: tuple[int, ...] | None

    def note(self) -> str:
        if self.ranks is None:
            return "it is torch's NON_GROUP_MEMBER: the group was created without this rank"
        return f"its ranks are {ranks_text(self.ranks)}"


def _members(value: Any, rank: int) -> Any:
    """A found value as member tuples (lists for lists), or an :class:`_Outside`."""
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, int) for v in value):
            return tuple(value)
        parts = [_members(v, rank) for v in value]
        return next((p for p in parts if isinstance(p, _Outside)), parts)
    if value is dist.GroupMember.NON_GROUP_MEMBER:
        return _Outside(None)
    if not isinstance(value, dist.ProcessGroup):
        raise TypeError(f"holds a {type(value).__name__} ({value!r}), not a process group")
    ranks = tuple(dist.get_process_group_ranks(value))
    return ranks if rank in ranks else _Outside(ranks)


def _expected_members(value: Any) -> Any:
    if value is None or (isinstance(value, list) and not value):
        return None
    if isinstance(value, list) and value and isinstance(value[0], (list, tuple)):
        return [tuple(v) for v in value]
    return tuple(value)


def _flat(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(r for part in value for r in part)
    return tuple(value)


def _same(found: Any, expected: Any, ordered: bool) -> bool:
    if isinstance(found, list) or isinstance(expected, list):
        if not (isinstance(found, list) and isinstance(expected, list)) or len(found) != len(expected):
            return False
        return all(_same(f, e, ordered) for f, e in zip(found, expected, strict=True))
    return found == expected if ordered else sorted(found) == sorted(expected)


def _compare(entry: Entry, expected: Any, rank: int, world: int, hint: Callable[[str, tuple], str]) -> Mismatch | None:
    """The finding for one entry, or ``None`` when it holds what MCore's layout has."""
    exp = _expected_members(expected)

    def found(trap: str, members: Any = None, note: str = "") -> Mismatch:
        return Mismatch(rank, entry.where, entry.kind, trap, _flat(exp), _flat(members), note)

    value = entry.value
    if value is MISSING:
        return None if exp is None else found("missing")
    if value is None or (isinstance(value, list) and not value):
        return None if exp is None or entry.optional else found("none")
    try:
        members = _members(value, rank)
    except TypeError as err:
        raise TypeError(f"{entry.where} {err}") from None
    if isinstance(members, _Outside):
        return Mismatch(rank, entry.where, entry.kind, "not_member", _flat(exp), members.ranks, members.note())
    if exp is None:
        return found("unexpected", members)
    if _same(members, exp, entry.ordered):
        return None
    flat = _flat(members)
    if value is dist.GroupMember.WORLD or (flat is not None and sorted(flat) == list(range(world))):
        return found("whole_world", members)
    if not (isinstance(members, list) or isinstance(exp, list)):
        return found("other_layout", members, hint(entry.kind, members))
    if isinstance(members, list) and isinstance(exp, list) and len(members) == len(exp):  # levels: the first wrong one
        level = next(i for i, (f, e) in enumerate(zip(members, exp, strict=True)) if not _same(f, e, entry.ordered))
        where = f"{entry.where} level {level}"
        return Mismatch(rank, where, entry.kind, "other_layout", exp[level], members[level])
    count = len(members) if isinstance(members, list) else 1
    return found("other_layout", members, f"{count} level(s) where MCore's layout has {len(exp)}")


def check_rank_groups(
    source: Any,
    *,
    release: str | Release | None = None,
    fields: Collection[str] | None = None,
    dim_kinds: Mapping[str, str] | None = None,
    **config: Any,
) -> RankCheck:
    """This rank's part of :func:`verify_groups`: its own findings, no communication.

    Reads ``source`` and compares each entry with the group MCore's layout of ``config`` gives
    this rank (work proportional to this rank's groups, not to the world). Arguments as for
    :func:`verify_groups`.

    Raises:
        RuntimeError: torch.distributed is not initialized (no default group).
        TypeError, ValueError, AssertionError: bad arguments, see :func:`verify_groups`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("verify_groups needs torch.distributed: no default group (call init_process_group() first)")
    rel = as_release(release)
    check_config(config, rel)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = stated_layout(config, rel, world)
    read = read_source(source, rel, fields, dim_kinds)
    by_global = expected_globals(layout, rank, config) if any(e.expect for e in read.entries) else {}
    others: dict[str, MegatronLayout | None] = {}

    def other(order: str) -> MegatronLayout | None:
        if order not in others:
            try:
                others[order] = stated_layout(config, rel, world, order=order)
            except (ValueError, RuntimeError, AssertionError, TypeError):
                others[order] = None
        return others[order]

    hint = fit_hint(layout, other, rank)
    if not read.entries:
        raise ValueError(
            f"nothing to check: this {read.what} holds no field, global or dim with a group kind of "
            f"megatron-core {rel.series} (fields={None if fields is None else list(fields)})"
        )
    mismatches = []
    for entry in read.entries:
        expected = by_global.get(entry.expect) if entry.expect else layout.group(entry.kind, rank)
        finding = _compare(entry, expected, rank, world, hint)
        if finding is not None:
            mismatches.append(finding)
    return RankCheck(rank, read.what, mismatches, len(read.entries), read.unchecked)
