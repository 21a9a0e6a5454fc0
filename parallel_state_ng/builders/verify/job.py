"""Every rank's check brought to every rank: :func:`verify_groups` (one all-gather).

Each rank runs :func:`~.rank_check.check_rank_groups`; one all-gather over the default group
brings every rank's findings, with a hash of its stated configuration, to every rank, which
all build the same :class:`~.findings.VerifyReport` or raise the same error. Creates no group.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import pickle
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist

from parallel_state_ng.builders.verify.findings import Mismatch, RankCheck, VerifyReport
from parallel_state_ng.builders.verify.rank_check import check_rank_groups
from parallel_state_ng.groups.agreement_protocol import canonical_json, fingerprint
from parallel_state_ng.groups.objects import object_to_tensor
from parallel_state_ng.releases import Release, as_release

__all__ = ["GroupMembershipError", "StatedConfigMismatchError", "verify_groups"]


class GroupMembershipError(ValueError):
    """The source holds groups some ranks are not members of (raised on every rank)."""


class StatedConfigMismatchError(ValueError):
    """The ranks stated different configurations or releases (raised on every rank)."""


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
