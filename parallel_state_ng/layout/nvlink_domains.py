"""NVLink domains as rank math: which domain a rank sits in, and which groups cross a domain.

On rack-scale NVLink systems (GB200/GB300 NVL72: 72 GPUs per NVLink domain) a process group
whose ranks sit in two domains leaves NVLink for the network. :class:`NvlinkDomains` states the
domains of a job: ``domain_size`` GPUs per domain, of which the job uses ``used_per_domain``
(default all), rank ``r`` in domain ``r // used_per_domain``. A partial last domain is allowed
(a world of 100 ranks on 72-GPU domains: 72 + 28). :func:`crossing_stats` counts, for one kind's
groups, the groups that cross a domain and how many domains each group spans (O(ranks of the
groups) in Python); :func:`crossing_stats_tensor` the same for groups as tensors (a layout's
groups as :class:`GroupRows`: first ranks plus fixed steps, :func:`kind_group_blocks`) against a
domain table, in tensor ops: the runtime check's path, no Python loop over groups or ranks.
Pure functions of their arguments. See docs/nvlink.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parallel_state_ng.layout.kinds import token_kind_dims
from parallel_state_ng.layout.named_layout import DimsArg, Layout

if TYPE_CHECKING:  # the tensor functions import torch when called: the list functions do not need it
    from typing import TypeAlias

    import torch

    from parallel_state_ng.layout.megatron_layout import MegatronLayout

__all__ = [
    "NVL72_DOMAIN_SIZE",
    "LATENCY_CRITICAL_KINDS",
    "NvlinkDomains",
    "crossing_stats",
    "crossing_stats_tensor",
    "domains_of_ranks",
    "GroupRows",
    "Block",
    "kind_group_blocks",
    "crossing_report",
    "kinds_crossing",
    "check_keep_inside",
]

#: GPUs per NVLink domain of a GB200/GB300 NVL72 rack.
NVL72_DOMAIN_SIZE = 72
#: Kinds whose traffic is latency-critical (tensor, context, expert and expert-tensor parallel):
#: the default of ``--keep-inside`` and of the runtime check (``PSNG_NVLINK_KEEP_INSIDE``).
LATENCY_CRITICAL_KINDS = ("tp", "cp", "ep", "ep_tp", "tp_ep_mp")
_MAX_EXAMPLES = 4


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class NvlinkDomains:
    """The NVLink domains of a job: ``domain_size`` GPUs each, ``used_per_domain`` of them used.

    Rank ``r`` sits in domain ``r // used_per_domain`` (launchers place ranks domain by domain).
    ``used_per_domain`` (default ``domain_size``) describes racks with GPUs the job leaves
    unused, e.g. 64 of each 72.

    Raises:
        ValueError: a size that is not a positive int, or ``used_per_domain > domain_size``
            (the message names the parameter and the value).
    """

    domain_size: int
    used_per_domain: int | None = None

    def __post_init__(self) -> None:
        _positive(self.domain_size, "domain_size")
        if self.used_per_domain is not None:
            _positive(self.used_per_domain, "used_per_domain")
            if self.used_per_domain > self.domain_size:
                raise ValueError(
                    f"used_per_domain {self.used_per_domain} is larger than domain_size {self.domain_size}: "
                    f"a domain holds at most {self.domain_size} GPUs"
                )

    @property
    def ranks_per_domain(self) -> int:
        """Ranks of the job in one (full) domain."""
        return self.domain_size if self.used_per_domain is None else self.used_per_domain

    def domain_of(self, rank: int) -> int:
        """The domain index of ``rank``."""
        return rank // self.ranks_per_domain

    def num_domains(self, world_size: int) -> int:
        """Domains a world of ``world_size`` ranks spans (the last may be partial)."""
        return -(-world_size // self.ranks_per_domain)

    def describe(self, world_size: int) -> dict[str, Any]:
        """JSON-ready facts: sizes, number of domains, ranks in the last domain."""
        per = self.ranks_per_domain
        last = world_size - (self.num_domains(world_size) - 1) * per
        return {
            "domain_size": self.domain_size,
            "ranks_per_domain": per,
            "num_domains": self.num_domains(world_size),
            "ranks_in_last_domain": last,
        }


def crossing_stats(
    groups: Sequence[Sequence[int]],
    domain_of: Callable[[int], Hashable],
    *,
    examples: int = _MAX_EXAMPLES,
    contiguous: bool = True,
) -> dict[str, Any]:
    """How one kind's ``groups`` sit in domains: counts, domains per group, crossing examples.

    Returns ``num_groups``, ``crossing_groups`` (groups spanning more than one domain),
    ``max_domains``, ``histogram`` (domains spanned -> number of groups, JSON keys as str) and
    up to ``examples`` crossing groups as ``{"ranks": [...], "domains": [...]}``.
    ``contiguous``: every domain is an interval of ranks (as :class:`NvlinkDomains` places
    them), so a group whose lowest and highest rank share a domain lies inside it (two lookups
    per group instead of one per rank).
    """
    spans: Counter[int] = Counter()
    shown: list[dict[str, Any]] = []
    crossing = 0
    for members in groups:
        if contiguous and members and domain_of(min(members)) == domain_of(max(members)):
            spans[1] += 1
            continue
        domains = list(dict.fromkeys(domain_of(r) for r in members))
        spans[len(domains)] += 1
        if len(domains) > 1:
            crossing += 1
            if len(shown) < examples:
                shown.append({"ranks": list(members), "domains": domains})
    return {
        "num_groups": len(groups),
        "crossing_groups": crossing,
        "max_domains": max(spans, default=0),
        "histogram": {str(k): spans[k] for k in sorted(spans)},
        "examples": shown,
    }


def domains_of_ranks(ranks: torch.Tensor, table: torch.Tensor, first_rank: int = 0) -> torch.Tensor:
    """The domain of each rank of ``ranks``: ``table[rank - first_rank]``, -1 outside the table."""
    import torch

    if table.numel() == 0:
        return torch.full_like(ranks, -1)
    index = ranks - first_rank
    inside = (index >= 0) & (index < table.numel())
    # index_select, not table[index]: advanced indexing enters a parallel region even for a few
    # thousand ranks, which stalls when the CPU is oversubscribed
    found = table.index_select(0, index.clamp(0, table.numel() - 1).reshape(-1)).reshape(ranks.shape)
    return torch.where(inside, found, -1)


def _row_min(rows: torch.Tensor) -> torch.Tensor:
    """The minimum of each row as the negated maximum of the negated rows: on int64 rows, amin
    over the last dim is about 40 times slower than amax (67 ms against 1.7 ms for 262,144 rows
    of 4, one thread, torch 2.13 CPU), and aminmax enters a parallel region even for a few rows.
    """
    return rows.neg().amax(1).neg()


@dataclass(frozen=True)
class GroupRows:
    """Groups as a first rank plus fixed steps: group ``g`` is ``bases[g] + offsets``.

    A plain layout's groups over some dims have this form (:meth:`of`): the bases are the ranks
    whose coordinates on those dims are 0, the offsets one group's ranks less its first. It holds
    O(groups + group size) numbers where the groups hold O(ranks); :meth:`rows` makes the rows.
    """

    bases: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, layout: Layout, dims: DimsArg) -> GroupRows | torch.Tensor:
        """``layout``'s groups over ``dims`` in :meth:`Layout.enumerate_groups`' order (the
        enumerated tensor for a split layout, whose ranks are not a sum of strides).
        """
        if not layout.is_plain:
            return layout.enumerate_groups(dims)
        inside = layout.dims(dims)
        outside = [name for name in layout.dim_names if name not in inside]
        first = layout.rank_offset
        return cls(layout.group_array(first, outside), layout.group_array(first, inside) - first)

    @property
    def shape(self) -> tuple[int, int]:
        """(number of groups, group size), as a tensor of the rows would have."""
        return self.bases.numel(), self.offsets.numel()

    def rows(self, which: torch.Tensor | None = None) -> torch.Tensor:
        """The groups (those ``which`` selects: a bool mask or indices) as (groups, size) rows."""
        bases = self.bases if which is None else self.bases[which]
        return bases[:, None] + self.offsets[None, :]


if TYPE_CHECKING:
    Block: TypeAlias = torch.Tensor | GroupRows


def __getattr__(name: str) -> Any:
    """``Block`` (a group block: a 2-D tensor or :class:`GroupRows`), made when first asked for."""
    if name == "Block":
        import torch

        return torch.Tensor | GroupRows
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def crossing_stats_tensor(
    groups: Block | Sequence[Block],
    table: torch.Tensor,
    *,
    first_rank: int = 0,
    examples: int = _MAX_EXAMPLES,
    contiguous: bool = True,
) -> dict[str, Any]:
    """:func:`crossing_stats` of groups given as tensors, in tensor ops.

    ``groups``: a 2-D int64 tensor (num_groups, group_size) or a :class:`GroupRows`, or a
    sequence of them (blocks, e.g. of different group sizes, taken in order). Rank ``r`` sits in
    domain ``table[r - first_rank]`` (-1 outside the table). The result equals
    :func:`crossing_stats` of the same groups as lists with that lookup and ``contiguous``.
    Python work is per block and per example, never per group or rank. With ``contiguous``
    only each group's lowest and highest rank are looked up (for :class:`GroupRows`:
    O(groups) tensor work, no row is made but those of crossing groups); the domains per group
    are counted (sorting each row) for the crossing groups only.

    Raises:
        ValueError: a block that is neither a 2-D integer tensor nor a :class:`GroupRows`.
    """
    import torch

    blocks = (groups,) if isinstance(groups, (torch.Tensor, GroupRows)) else tuple(groups)
    spans: Counter[int] = Counter()
    shown: list[dict[str, Any]] = []
    crossing = num_groups = 0
    for i, block in enumerate(blocks):
        if not isinstance(block, GroupRows) and (
            not isinstance(block, torch.Tensor) or block.dim() != 2 or block.is_floating_point()
        ):
            what = tuple(block.shape) if isinstance(block, torch.Tensor) else type(block).__name__
            raise ValueError(
                f"groups[{i}] must be a 2-D integer tensor (num_groups, group_size) or GroupRows, got {what}"
            )
        rows, size = block.shape
        num_groups += rows
        if rows and not size:
            spans[0] += rows  # empty groups span no domain
        if not rows or not size:
            continue
        domains = None
        if contiguous:  # a domain is an interval: the lowest and highest rank decide
            if isinstance(block, GroupRows):
                lowest, highest = block.bases + block.offsets.min(), block.bases + block.offsets.max()
            else:
                lowest, highest = _row_min(block), block.amax(1)
            crosses = domains_of_ranks(lowest, table, first_rank) != domains_of_ranks(highest, table, first_rank)
        else:
            domains = domains_of_ranks(block.rows() if isinstance(block, GroupRows) else block, table, first_rank)
            crosses = _row_min(domains) != domains.amax(1)
        count = int(crosses.sum())
        if rows > count:
            spans[1] += rows - count
        if not count:
            continue
        crossing += count
        members = block.rows(crosses) if isinstance(block, GroupRows) else block[crosses]
        found = domains_of_ranks(members, table, first_rank) if domains is None else domains[crosses]
        ordered = found.sort(1).values
        distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(1) + 1
        values, counts = torch.unique(distinct, return_counts=True)
        spans.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))
        more = max(examples - len(shown), 0)
        for ranks, of_ranks in zip(members[:more].tolist(), found[:more].tolist(), strict=True):
            shown.append({"ranks": ranks, "domains": list(dict.fromkeys(of_ranks))})
    return {
        "num_groups": num_groups,
        "crossing_groups": crossing,
        "max_domains": max(spans, default=0),
        "histogram": {str(k): spans[k] for k in sorted(spans)},
        "examples": shown,
    }


def kind_group_blocks(layout: MegatronLayout, kind: str) -> tuple[Block, ...] | None:
    """Every group of ``kind`` as blocks (:class:`GroupRows`), rows in
    :meth:`MegatronLayout.enumerate`'s order.

    One block for a kind read off a rank-generator token (tp, cp, ep, ep_tp, tp_ep_mp, dp, ...;
    0.19's GTP kinds included): the dense or expert layout's groups over the kind's dims; with
    a 0.12/0.13 encoder block, the encoder's block then the decoder's. ``None`` (enumerate them
    as lists) for the derived kinds (partial data parallel, hierarchical context parallel,
    embeddings, optimizer instances, all-gather twins: their groups come from other rules or in
    first-rank order) and for an encoder layout's ``pp`` and ``mp`` (stitched pipelines).
    """
    if kind not in layout.token_kinds:
        return None
    view, dims = token_kind_dims(layout.facts.gtp_remat_axis)[kind]
    grid = layout.decoder if view == "dense" else layout.expert
    encoder = layout.encoder_block
    if encoder is None:
        return (GroupRows.of(grid, dims),)
    if kind in ("pp", "mp"):
        return None
    return (GroupRows.of(encoder.encoder, dims), GroupRows.of(grid, dims))


def crossing_report(
    groups_of: Mapping[str, Sequence[Sequence[int]]], domain_of: Callable[[int], Hashable]
) -> dict[str, dict[str, Any]]:
    """:func:`crossing_stats` for each kind of ``groups_of`` (kind -> its groups)."""
    return {kind: crossing_stats(groups, domain_of) for kind, groups in groups_of.items()}


def kinds_crossing(report: Mapping[str, Mapping[str, Any]], kinds: Sequence[str]) -> list[str]:
    """The kinds of ``kinds`` (present in ``report``) with at least one crossing group."""
    return [k for k in kinds if k in report and report[k]["crossing_groups"]]


def check_keep_inside(kinds: Sequence[str], known: Sequence[str], what: str = "keep_inside") -> list[str]:
    """``kinds`` as a list, each one of ``known``; ``ValueError`` naming ``what`` otherwise."""
    unknown = [k for k in kinds if k not in known]
    if unknown or not kinds:
        raise ValueError(
            f"{what}: unknown group kind(s) {unknown if unknown else list(kinds)}; known kinds: {','.join(known)}"
        )
    return list(kinds)
