"""The runtime NVLink-domain check: groups of latency-critical kinds that cross a domain.

Every rank states the NVLink domain it sits in; the id rides on the agreement check's round
(:func:`~parallel_state_ng.groups.agreement.check_agreement`'s ``rank_value``: no extra store
operation), the comparing rank turns every participant's id into a compact domain map
(:func:`summarize_domain_ids`), and every rank checks the layout's groups of the chosen kinds
against it (:func:`check_domains`, tensor ops over the layout's groups: no Python loop over
groups or ranks): a warning, or :class:`NvlinkDomainError` on every rank
before any group is created. Where a rank's id comes from, first found:

1. a callable set with :func:`set_nvlink_domain_source` (returns an int, a str, a tuple of
   them, or ``None``);
2. ``$PSNG_NVLINK_DOMAIN`` (set by the launcher, e.g. the rack name);
3. NVML's GPU fabric info (``pynvml``, when importable and the GPU reports a completed fabric
   registration): the cluster UUID and clique id, ``(uuid_hex, clique_id)``.

``$PSNG_NVLINK_CHECK`` is ``warn`` (default), ``error`` or ``off``; ``$PSNG_NVLINK_KEEP_INSIDE``
the kinds checked (default :data:`~parallel_state_ng.layout.nvlink_domains.LATENCY_CRITICAL_KINDS`).
Ids of different types (or tuples of different lengths) across ranks raise
:class:`NvlinkDomainIdError`. See docs/nvlink.md.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from parallel_state_ng.layout.bounded_input import shown
from parallel_state_ng.layout.megatron_layout import GROUP_KINDS
from parallel_state_ng.layout.nvlink_domains import (
    LATENCY_CRITICAL_KINDS,
    Block,
    GroupRows,
    crossing_stats,
    crossing_stats_tensor,
)

__all__ = [
    "ENV_DOMAIN",
    "ENV_CHECK",
    "ENV_KEEP_INSIDE",
    "CHECK_FIELD",
    "NvlinkDomainError",
    "NvlinkDomainIdError",
    "NvlinkDomainWarning",
    "set_nvlink_domain_source",
    "nvlink_check_settings",
    "local_domain_id",
    "nvml_domain_id",
    "encode_domain_id",
    "summarize_domain_ids",
    "domain_table",
    "Groups",
    "round_arguments",
    "raise_if_invalid",
    "check_domains",
]

ENV_DOMAIN = "PSNG_NVLINK_DOMAIN"
ENV_CHECK = "PSNG_NVLINK_CHECK"
ENV_KEEP_INSIDE = "PSNG_NVLINK_KEEP_INSIDE"
#: The agreement field carrying the check's settings: ranks must agree on warn/error and kinds.
CHECK_FIELD = "NVLink domain check (PSNG_NVLINK_CHECK, PSNG_NVLINK_KEEP_INSIDE)"
_MODES = ("warn", "error", "off")
#: How :func:`round_arguments` marks a setting or id that could not be read.
INVALID = "invalid: "
_MAX_IDS = 64  # distinct ids named in the summary (more: domains are named by index only)
_MAX_REPORTED = 3  # crossing groups named per kind

DomainId = int | str | tuple[int | str, ...]
#: One kind's groups: a 2-D int64 tensor or GroupRows, a tuple of them (blocks), or lists of ranks.
Groups = Block | tuple[Block, ...] | Sequence[Sequence[int]]


class NvlinkDomainError(RuntimeError):
    """Groups of a kind kept inside NVLink domains cross one (``PSNG_NVLINK_CHECK=error``)."""


class NvlinkDomainIdError(ValueError):
    """Ranks stated NVLink domain ids of different types or lengths, or an id is invalid."""


class NvlinkDomainWarning(UserWarning):
    """Groups of a kind kept inside NVLink domains cross one (``PSNG_NVLINK_CHECK=warn``)."""


_source: Callable[[], Any] | None = None
_nvml_ids: dict[int, tuple[str, int] | None] = {}  # LOCAL_RANK -> NVML's answer, asked once per process


def set_nvlink_domain_source(source: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """Use ``source()`` as this rank's NVLink domain id (``None``: back to the environment / NVML).

    ``source`` returns an int, a str, a tuple of ints and strs, or ``None`` (no id: this rank
    takes no part in the check). Set it the same way on every rank. Returns the previous source.
    """
    global _source
    if source is not None and not callable(source):
        raise TypeError(f"source must be a callable returning the NVLink domain id, or None; got {source!r}")
    previous, _source = _source, source
    return previous


def nvlink_check_settings() -> tuple[str, tuple[str, ...]]:
    """``(mode, kinds)`` from ``$PSNG_NVLINK_CHECK`` and ``$PSNG_NVLINK_KEEP_INSIDE``.

    Raises:
        ValueError: a mode other than warn/error/off, or an unknown kind (names the variable).
    """
    mode = os.environ.get(ENV_CHECK, "warn").strip().lower() or "warn"
    if mode not in _MODES:
        raise ValueError(f"environment variable {ENV_CHECK} must be one of {_MODES}, got {os.environ[ENV_CHECK]!r}")
    raw = os.environ.get(ENV_KEEP_INSIDE)
    if raw is None or not raw.strip():
        return mode, LATENCY_CRITICAL_KINDS
    kinds = tuple(k.strip() for k in raw.split(",") if k.strip())
    unknown = [k for k in kinds if k not in GROUP_KINDS]
    if unknown:
        raise ValueError(
            f"environment variable {ENV_KEEP_INSIDE}: unknown group kind(s) {unknown} in {raw!r}; "
            f"known kinds: {','.join(GROUP_KINDS)}"
        )
    return mode, kinds


def _check_id(value: Any, source: str) -> DomainId | None:
    """``value`` as a domain id; ``NvlinkDomainIdError`` naming ``source`` if it is not one."""

    def atom(v: Any) -> bool:
        return (isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, str)

    if value is None or atom(value):
        return value
    if isinstance(value, (tuple, list)) and value and all(atom(v) for v in value):
        return tuple(value)
    raise NvlinkDomainIdError(
        f"{source}: an NVLink domain id is an int, a str or a non-empty tuple of them, got {shown(value)}"
    )


def nvml_domain_id(device_index: int | None = None) -> tuple[str, int] | None:
    """``(cluster_uuid_hex, clique_id)`` of this GPU's NVLink fabric from NVML, or ``None``.

    ``None`` when ``pynvml`` is not importable, NVML does not start, the GPU has no fabric
    (not an NVLink-domain system) or its registration is not complete. ``device_index``
    (default ``$LOCAL_RANK``, else 0) is the NVML index of this rank's GPU. Never raises.
    """
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        index = int(os.environ.get("LOCAL_RANK", "0")) if device_index is None else device_index
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if hasattr(pynvml, "nvmlDeviceGetGpuFabricInfoV"):
                info = pynvml.c_nvmlGpuFabricInfoV_t()
                info.version = pynvml.nvmlGpuFabricInfo_v2
                pynvml.nvmlDeviceGetGpuFabricInfoV(handle, _byref(info))
            else:
                info = pynvml.c_nvmlGpuFabricInfo_t()
                pynvml.nvmlDeviceGetGpuFabricInfo(handle, _byref(info))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no fabric, an old driver: no id from NVML
        return None
    completed = getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
    uuid = bytes(info.clusterUuid)
    if info.state != completed or info.status != 0 or not any(uuid):
        return None
    return uuid.hex(), int(info.cliqueId)


def _byref(info: Any) -> Any:
    import ctypes

    return ctypes.byref(info)


def local_domain_id() -> tuple[str, DomainId] | None:
    """``(source, id)`` of this rank: the callable, ``$PSNG_NVLINK_DOMAIN``, then NVML; ``None``: none."""
    if _source is not None:
        value = _check_id(_source(), "the NVLink domain source set with set_nvlink_domain_source")
        return None if value is None else ("callable", value)
    env = os.environ.get(ENV_DOMAIN)
    if env is not None:
        if not env.strip():
            raise NvlinkDomainIdError(f"environment variable {ENV_DOMAIN} is set but empty; unset it or name a domain")
        return "env", env.strip()
    local = os.environ.get("LOCAL_RANK", "0").strip()
    index = int(local) if local.isdigit() else 0  # every GPU of a node sits in the node's domain
    if index not in _nvml_ids:  # a GPU's fabric does not change while the process runs: ask NVML once
        _nvml_ids[index] = nvml_domain_id(index)
    nvml = _nvml_ids[index]
    return None if nvml is None else ("nvml", nvml)


def encode_domain_id(found: tuple[str, DomainId] | None) -> str | None:
    """The rank value sent on the agreement round: JSON ``[source, id]`` (``None``: no id)."""
    return None if found is None else json.dumps([found[0], found[1]], separators=(",", ":"))


def _shape(decoded: Any) -> str:
    if decoded is None:
        return "no id"
    source, value = decoded
    if isinstance(value, list):
        return f"{source}: tuple of {len(value)}"
    return f"{source}: {type(value).__name__}"


def _ranges(ranks: Sequence[int]) -> str:
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def summarize_domain_ids(ranks: Sequence[int], values: list[str | None]) -> dict[str, Any] | None:
    """The domain map every participant receives (run by the comparing rank, O(participants)).

    ``None`` when no rank sent an id. Otherwise ``{"ranks": {"range": [start, stop]} or {"list":
    [...]}, "runs":
    [[domain, count], ...], "ids": [...] or None}`` with domains numbered by first appearance,
    or ``{"error": text}`` when the ids differ in type or length across ranks.
    """
    if all(v is None for v in values):
        return None
    # the values repeat (one per domain): decode each distinct one once
    distinct: dict[str | None, Any] = {v: None if v is None else json.loads(v) for v in dict.fromkeys(values)}
    shapes: dict[str, list[int]] = {}
    shape_of = {v: _shape(d) for v, d in distinct.items()}
    if len(set(shape_of.values())) > 1:
        for rank, v in zip(ranks, values, strict=True):
            shapes.setdefault(shape_of[v], []).append(rank)
        kinds = "; ".join(f"{shape} on ranks {_ranges(members)}" for shape, members in shapes.items())
        return {"error": f"the NVLink domain ids of the ranks differ in type or length ({kinds})"}
    index: dict[str, int] = {}  # an id (its JSON) -> domain number, by first appearance
    domain_of_value = {v: index.setdefault(json.dumps(d[1]), len(index)) for v, d in distinct.items()}
    runs: list[list[int]] = []
    for v in values:
        domain = domain_of_value[v]
        if runs and runs[-1][0] == domain:
            runs[-1][1] += 1
        else:
            runs.append([domain, 1])
    contiguous = isinstance(ranks, range) and ranks.step == 1
    return {
        "ranks": {"range": [ranks[0], ranks[-1] + 1]} if contiguous else {"list": list(ranks)},
        "runs": runs,
        "ids": [json.loads(k) for k in index] if len(index) <= _MAX_IDS else None,
    }


def domain_table(summary: Mapping[str, Any]) -> tuple[int, torch.Tensor]:
    """``(first_rank, table)`` of a domain map: rank ``r`` sits in domain ``table[r - first_rank]``
    (-1: not a participant). Tensor work over the map's runs (``repeat_interleave``), no Python
    loop over ranks.
    """
    return _table(_runs(summary), summary["ranks"])


def _runs(summary: Mapping[str, Any]) -> torch.Tensor:
    """The map's runs as an int64 tensor of (domain, count) rows."""
    return torch.tensor(summary["runs"], dtype=torch.int64).reshape(-1, 2)


def _table(runs: torch.Tensor, ranks: Mapping[str, Any]) -> tuple[int, torch.Tensor]:
    """:func:`domain_table` from the runs tensor and the summary's participants."""
    domains = torch.repeat_interleave(runs[:, 0], runs[:, 1])
    if "range" in ranks:
        return int(ranks["range"][0]), domains
    listed = torch.tensor(ranks["list"], dtype=torch.int64)
    first = int(listed.min())
    table = torch.full((int(listed.max()) - first + 1,), -1, dtype=torch.int64)
    table.index_copy_(0, listed - first, domains)
    return first, table


def _blocks(groups: Groups) -> tuple[Block, ...] | None:
    """``groups`` as tensor blocks, or ``None`` when they are lists of ranks."""
    if isinstance(groups, (torch.Tensor, GroupRows)):
        return (groups,)
    if isinstance(groups, tuple) and groups and all(isinstance(block, (torch.Tensor, GroupRows)) for block in groups):
        return cast("tuple[Block, ...]", groups)
    return None


def _stats(groups: Groups, first: int, table: torch.Tensor, contiguous: bool) -> dict[str, Any] | None:
    """One kind's crossing stats (``None``: no group): tensors in tensor ops, lists by lookup."""
    blocks = _blocks(groups)
    if blocks is not None:
        stats = crossing_stats_tensor(blocks, table, first_rank=first, examples=_MAX_REPORTED, contiguous=contiguous)
        return stats if stats["num_groups"] else None
    lists = cast("Sequence[Sequence[int]]", groups)
    if not lists:
        return None
    domains = table.tolist()  # the list path (derived kinds): one lookup per rank

    def lookup(rank: int) -> int:
        return domains[rank - first] if 0 <= rank - first < len(domains) else -1

    return crossing_stats(lists, lookup, examples=_MAX_REPORTED, contiguous=contiguous)


def _name(domain: int, ids: Sequence[Any] | None) -> str:
    return str(domain) if ids is None else f"{domain} ({json.dumps(ids[domain])})"


def round_arguments() -> tuple[str, str | None, Any]:
    """What a rank adds to an agreement round: ``(field value, rank value, summarize)``.

    The field value (compared under :data:`CHECK_FIELD`) is the mode and kinds, or the error
    that reading them or this rank's id raised: a rank with a bad setting then meets the others
    in the round (a mismatch names it on every rank) instead of leaving them to time out. With
    the check off no id is read and nothing is added to the round.
    """
    try:
        mode, kinds = nvlink_check_settings()
        if mode == "off":
            return "off", None, None
        value = encode_domain_id(local_domain_id())
    except Exception as err:  # noqa: BLE001 - a user source may raise anything: every rank must hear of it
        reason = str(err) if isinstance(err, (ValueError, TypeError)) else f"{type(err).__name__}: {err}"
        return f"{INVALID}{reason}", None, None
    return f"{mode}:{','.join(kinds)}", value, summarize_domain_ids


def raise_if_invalid(field: str, name: str) -> None:
    """Raise :class:`NvlinkDomainIdError` when ``field`` (from :func:`round_arguments`, agreed by
    every participant) says a setting or id could not be read; every rank raises the same.
    """
    if field.startswith(INVALID):
        raise NvlinkDomainIdError(f"{name}: NVLink domain check: {field[len(INVALID) :]}")


def check_domains(
    summary: Mapping[str, Any] | None,
    groups_of: Callable[[Sequence[str]], Mapping[str, Mapping[str, Groups]]],
    *,
    name: str,
    rank: int,
) -> list[str]:
    """Check the groups of the chosen kinds against the agreed domain map; the findings.

    ``groups_of(kinds)`` returns label (a module, or ``""``) -> kind -> groups; it is called only
    when the participants span more than one domain. Groups given as a 2-D int64 tensor or a
    :class:`~parallel_state_ng.layout.nvlink_domains.GroupRows` (or a tuple of them, e.g. from
    :func:`~parallel_state_ng.layout.nvlink_domains.kind_group_blocks`) are checked in tensor
    ops (:func:`~parallel_state_ng.layout.nvlink_domains.crossing_stats_tensor`: no Python loop
    over groups or ranks), lists of rank lists group by group. The first participant (``rank``:
    this one's global rank) emits the warning. Returns one line per crossing kind (empty: all
    inside, or nothing known).

    Raises:
        NvlinkDomainIdError: the ranks' ids differ in type or length (on every rank).
        NvlinkDomainError: a kind crosses and ``$PSNG_NVLINK_CHECK`` is ``error`` (every rank).
    """
    if summary is None:
        return []
    if "error" in summary:
        raise NvlinkDomainIdError(f"{name}: {summary['error']}; every rank must state its domain the same way")
    mode, kinds = nvlink_check_settings()
    if mode == "off":
        return []
    runs = _runs(summary)
    num_domains = torch.unique(runs[:, 0]).numel()
    if num_domains < 2:
        return []
    first, table = _table(runs, summary["ranks"])
    contiguous = len(runs) == num_domains and "range" in summary["ranks"]  # each domain one interval
    ids = summary.get("ids")
    findings = []
    for label, by_kind in groups_of(kinds).items():
        where = f"{label}: " if label else ""
        for kind in kinds:
            groups = by_kind.get(kind)
            stats = None if groups is None else _stats(groups, first, table, contiguous)
            if stats is None or not stats["crossing_groups"]:
                continue
            shown = "; ".join(
                f"ranks {_ranges(sorted(e['ranks']))} in domains {', '.join(_name(d, ids) for d in e['domains'])}"
                for e in stats["examples"]
            )
            findings.append(
                f"{where}{kind}: {stats['crossing_groups']} of {stats['num_groups']} groups cross NVLink domains "
                f"(up to {stats['max_domains']}), e.g. {shown}"
            )
    if findings:
        text = (
            f"{name}: groups that should stay inside an NVLink domain ({','.join(kinds)}) cross one, so their "
            f"traffic leaves NVLink for the network:\n  " + "\n  ".join(findings) + "\n"
            f"See `python -m parallel_state_ng layout ... --nvlink-domain-size N --suggest-order`; "
            f"{ENV_CHECK}={mode} ({ENV_CHECK}=off turns the check off)."
        )
        if mode == "error":
            raise NvlinkDomainError(text)
        first = summary["ranks"]["range"][0] if "range" in summary["ranks"] else summary["ranks"]["list"][0]
        if rank == first:
            warnings.warn(text, NvlinkDomainWarning, stacklevel=3)
    return findings
