"""NVLink domains as rank math: which domain a rank sits in, and which groups cross a domain.

On rack-scale NVLink systems (GB200/GB300 NVL72: 72 GPUs per NVLink domain) a process group
whose ranks sit in two domains leaves NVLink for the network. :class:`NvlinkDomains` states the
domains of a job: ``domain_size`` GPUs per domain, of which the job uses ``used_per_domain``
(default all), rank ``r`` in domain ``r // used_per_domain``. A partial last domain is allowed
(a world of 100 ranks on 72-GPU domains: 72 + 28). :func:`crossing_stats` counts, for one kind's
groups, the groups that cross a domain and how many domains each group spans. Pure functions of
their arguments (O(ranks of the groups)). See docs/nvlink.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NVL72_DOMAIN_SIZE",
    "LATENCY_CRITICAL_KINDS",
    "NvlinkDomains",
    "crossing_stats",
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
