"""Check a live job's process groups against the layout MCore would build: :func:`verify_groups`.

Each rank computes, from :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout` and
its group plan, the groups MCore gives *its own* rank for the stated configuration (no loop over
the world; :mod:`parallel_state_ng.builders.verify_expected`), compares them with what the
source holds (read by :mod:`parallel_state_ng.builders.verify_sources`), and one all-gather over
the default group brings every rank's findings, with a hash of its stated configuration, to
every rank. Creates no group. See docs/engine.md ("Checking a job's groups").
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import pickle
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel_state_ng.builders.verify_expected import check_config, expected_globals, fit_hint, stated_layout
from parallel_state_ng.builders.verify_sources import MISSING, Entry, read_source
from parallel_state_ng.groups.agreement_protocol import canonical_json, fingerprint
from parallel_state_ng.groups.objects import object_to_tensor
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.releases import Release, as_release

__all__ = [
    "TRAPS",
    "Mismatch",
    "RankCheck",
    "VerifyReport",
    "GroupMembershipError",
    "StatedConfigMismatchError",
    "check_rank_groups",
    "verify_groups",
]

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


class GroupMembershipError(ValueError):
    """The source holds groups some ranks are not members of (raised on every rank)."""


class StatedConfigMismatchError(ValueError):
    """The ranks stated different configurations or releases (raised on every rank)."""


def _ranks_text(ranks: tuple[int, ...] | None) -> str:
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
        exp, got = _ranks_text(self.expected), _ranks_text(self.found)
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


# --------------------------------------------------------------------------- comparing one entry
@dataclass(frozen=True)
class _Outside:
    """A group the rank is not in: its ranks, or ``None`` for torch's ``NON_GROUP_MEMBER``."""

    ranks: tuple[int, ...] | None

    def note(self) -> str:
        if self.ranks is None:
            return "it is torch's NON_GROUP_MEMBER: the group was created without this rank"
        return f"its ranks are {_ranks_text(self.ranks)}"


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


# --------------------------------------------------------------------------- one rank, then all
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


def _stated(config: Mapping[str, Any], release: str | Release | None) -> tuple[dict[str, Any], str]:
    """The stated configuration as shown and hashed, and the release's series (raw if unknown)."""
    try:
        series = as_release(release).series
    except (ValueError, TypeError):
        series = str(release)
    return dict(config), series


def _rank_ranges(ranks: list[int]) -> str:
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


def _disagreement(configs: list[str]) -> str:
    """The message naming each stated configuration, its ranks, and the arguments that differ."""
    by_config: dict[str, list[int]] = {}
    for rank, text in enumerate(configs):
        by_config.setdefault(text, []).append(rank)
    parsed = [json.loads(text) for text in by_config]
    names = sorted({name for p in parsed for name in p if len({json.dumps(q.get(name)) for q in parsed}) > 1})
    lines = [f"  {_rank_ranges(ranks)}: {text}" for text, ranks in by_config.items()]
    return (
        f"verify_groups: the ranks stated {len(by_config)} different configurations (every rank must state "
        f"the same arguments and release); they differ in {', '.join(names)}:\n" + "\n".join(lines)
    )


def _all_gather_small(obj: Any) -> list[Any]:
    """Every rank's small picklable ``obj``, in rank order: one all-gather of sizes, one of bytes.

    Into one flat tensor each and decoded at once (no per-rank tensors: 65,536 ranks' findings
    arrive in well under a second).
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name
    payload = object_to_tensor(obj)
    n = dist.get_world_size()
    sizes = torch.empty(n, dtype=torch.int64)
    gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64))
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = torch.empty(n * longest, dtype=torch.uint8)
    gather(gathered, padded)
    data = bytes(gathered.tolist())
    return [pickle.loads(data[i * longest : i * longest + size]) for i, size in enumerate(sizes.tolist())]


def _packed(check: RankCheck) -> tuple:
    """A rank's check as plain tuples (a few dozen bytes when it found nothing)."""
    return (
        check.source,
        check.checked,
        tuple(check.unchecked),
        tuple(dataclasses.astuple(m) for m in check.mismatches),
    )


def _raise_gathered_error(mine: BaseException | None, failed: list[tuple[int, str, str]]) -> None:
    """Raise on every rank after some rank failed locally: its own error, else the first rank's."""
    if mine is not None:
        raise mine
    rank, type_name, message = failed[0]
    cls = getattr(builtins, type_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise cls(f"verify_groups failed on rank {rank}{others}: {type_name}: {message}")


def verify_groups(
    source: Any,
    *,
    release: str | Release | None = None,
    fields: Collection[str] | None = None,
    dim_kinds: Mapping[str, str] | None = None,
    raise_as: type[BaseException] | None = None,
    **config: Any,
) -> VerifyReport:
    """Check that ``source`` holds, on every rank, the groups MCore's layout of ``config`` gives it.

    Collective over the default group: every rank calls it. One exchange: an all-gather of each
    rank's findings (sizes, then bytes), tens of bytes per rank when it found nothing.

    Args:
        source: what the job has: a ``ProcessGroupCollection`` (MCore's, from
            ``build_megatron_groups(...).collection()``, ``compat.pg_collection``, or by hand), a
            dict of field -> group, a :class:`~parallel_state_ng.builders.collection.MegatronGroups`,
            a ``parallel_state`` module after init (``compat.parallel_state`` or
            ``megatron.core.parallel_state``), a ``HyperCommGrid`` (ours or MCore's: its created
            groups) or a ``DeviceMesh`` with dim names (``tp``, ``pp``, ``dp``, ``cp``, ``ep``,
            ``etp``, ``edp``; flattened dims such as ``dp_cp`` too).
        release: the megatron-core release whose layout applies (default: the served one).
        fields: check only these names of the source (fields, globals, dims or grid keys).
        dim_kinds: dim name -> group kind, for mesh or grid dims named otherwise.
        raise_as: raise this exception type with :meth:`VerifyReport.render` as its message,
            on every rank, instead of returning a report that is not ok.
        **config: the stated configuration: ``initialize_model_parallel``'s arguments
            (``tensor_model_parallel_size``, ``order``, ...; those that change no group are
            accepted and ignored), ``rank_offset`` and ``world_size`` (the layout's ranks).

    Returns:
        The same :class:`VerifyReport` on every rank: ``ok``, every rank's findings, ``render()``.

    Raises:
        StatedConfigMismatchError: ranks stated different configurations or releases (every
            rank, naming the ranks and the configurations).
        GroupMembershipError: the source holds a group some rank is not in (every rank).
        TypeError, ValueError, AssertionError, RuntimeError: bad input (wrong source type, unknown
            field or argument names, a DeviceMesh without dim names, an impossible configuration),
            on every rank; RuntimeError without a default group (nothing is communicated then).
        raise_as: the report is not ok and ``raise_as`` was given.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("verify_groups needs torch.distributed: no default group (call init_process_group() first)")
    stated, series = _stated(config, release)
    digest = fingerprint({**stated, "release": series})[:16]
    mine: BaseException | None = None
    result: RankCheck | None = None
    try:
        if raise_as is not None and not (isinstance(raise_as, type) and issubclass(raise_as, BaseException)):
            raise TypeError(f"raise_as must be an exception class, got {raise_as!r}")
        result = check_rank_groups(source, release=release, fields=fields, dim_kinds=dim_kinds, **config)
    except Exception as err:  # noqa: BLE001 - sent to every rank, raised after the gather
        mine = err
    error = None if mine is None else (type(mine).__name__, str(mine))
    gathered = _all_gather_small((digest, None if result is None else _packed(result), error))
    digests = [g[0] for g in gathered]
    if len(set(digests)) > 1:
        configs = _all_gather_small(canonical_json({**stated, "release": series}))  # every rank is here
        raise StatedConfigMismatchError(_disagreement(configs))
    failed = [(r, g[2][0], g[2][1]) for r, g in enumerate(gathered) if g[2] is not None]
    if failed:
        _raise_gathered_error(mine, failed)
    packed = [g[1] for g in gathered]
    mismatches = [Mismatch(*m) for p in packed for m in p[3]]
    fatal = [m for m in mismatches if m.trap == "not_member"]
    if fatal:
        raise GroupMembershipError(
            f"verify_groups: the source holds groups that {len({m.rank for m in fatal})} rank(s) are not in:\n"
            + "\n".join("  " + m.message() for m in fatal)
        )
    report = VerifyReport(
        ok=not mismatches,
        mismatches=mismatches,
        source=packed[0][0],
        release=series,
        config=stated,
        world_size=len(gathered),
        checked=sum(p[1] for p in packed),
        unchecked=sorted({name for p in packed for name in p[2]}),
    )
    if mismatches and raise_as is not None:
        raise raise_as(report.render())
    return report
