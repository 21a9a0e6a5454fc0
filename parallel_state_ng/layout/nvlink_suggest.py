"""Orders and module placements that keep chosen group kinds inside NVLink domains.

:func:`suggest_orders` tries every ``order`` a release's ``initialize_model_parallel`` accepts
for a configuration (the 120 permutations of ``tp-cp-ep-dp-pp`` that
:class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout` validates; orders that differ
only in where size-1 tokens sit build the same groups and are listed once) and ranks them by the
kinds that still cross a domain, then by the crossing groups. :func:`suggest_placements` does
the same for a multi-module topology: every order of the modules' rank spans along the rank
axis (the ``rank_offset`` of each module), each module with its best order. :func:`why_crossing`
says why a kind cannot stay inside (a group larger than a domain, or a size that does not divide
the domain's ranks). Pure functions; work O(orders x world) (a report tool). See docs/nvlink.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.nvlink_domains import NvlinkDomains, crossing_stats
from parallel_state_ng.layout.order import DEFAULT_ORDER
from parallel_state_ng.layout.topology_spec import ModulePlacement, TopologySpecError, validate_topology

__all__ = [
    "ORDER_CANDIDATE_TOKENS",
    "MAX_MODULE_SPANS",
    "OrderCandidate",
    "candidate_orders",
    "score_layout",
    "suggest_orders",
    "why_crossing",
    "suggest_fill",
    "suggest_placements",
]

#: The tokens whose permutations are tried (``tp-cp-ep-dp-pp`` in every order).
ORDER_CANDIDATE_TOKENS = ("tp", "cp", "ep", "dp", "pp")
#: Most disjoint module spans whose arrangements are all tried (7! = 5,040).
MAX_MODULE_SPANS = 7


@dataclass(frozen=True)
class OrderCandidate:
    """One order and how its layout sits in the domains.

    ``crossing_kinds``: kept kinds with a crossing group; ``crossing``: kind -> crossing groups
    (every kept kind); ``max_domains``: kind -> most domains one group spans; ``same_as``:
    further orders that build the same layout.
    """

    order: str
    crossing_kinds: tuple[str, ...]
    crossing: Mapping[str, int]
    max_domains: Mapping[str, int]
    same_as: tuple[str, ...] = ()

    @property
    def rank_key(self) -> tuple[int, int, int]:
        """Sort key: kinds crossing, then crossing groups, then the widest span."""
        return (len(self.crossing_kinds), sum(self.crossing.values()), max(self.max_domains.values(), default=0))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "order": self.order,
            "crossing_kinds": list(self.crossing_kinds),
            "crossing_groups": dict(self.crossing),
            "max_domains": dict(self.max_domains),
            "same_as": list(self.same_as),
        }


def candidate_orders() -> list[str]:
    """The default order first, then every other permutation of :data:`ORDER_CANDIDATE_TOKENS`."""
    others = ["-".join(p) for p in itertools.permutations(ORDER_CANDIDATE_TOKENS)]
    return [DEFAULT_ORDER, *(o for o in others if o != DEFAULT_ORDER)]


def _effective(layout: MegatronLayout) -> tuple:
    """What an order changes: the dense and expert dims of size > 1, fastest first."""
    dense = tuple(n for n, s in zip(layout.decoder.dim_names, layout.decoder.shape, strict=True) if s > 1)
    expert = tuple(n for n, s in zip(layout.expert.dim_names, layout.expert.shape, strict=True) if s > 1)
    return dense, expert


def score_layout(
    layout: MegatronLayout, domains: NvlinkDomains, keep_inside: Sequence[str], same_as: Sequence[str] = ()
) -> OrderCandidate:
    """The :class:`OrderCandidate` of ``layout`` (kinds it does not build are skipped)."""
    built = layout.kinds()
    crossing: dict[str, int] = {}
    widest: dict[str, int] = {}
    for kind in keep_inside:
        if kind in built:
            stats = crossing_stats(layout.enumerate(kind), domains.domain_of, examples=0)
            crossing[kind], widest[kind] = stats["crossing_groups"], stats["max_domains"]
    kinds = tuple(k for k, n in crossing.items() if n)
    return OrderCandidate(layout.order, kinds, crossing, widest, tuple(same_as))


def suggest_orders(
    layout_arguments: Mapping[str, Any], domains: NvlinkDomains, keep_inside: Sequence[str]
) -> list[OrderCandidate]:
    """Every accepted order for ``layout_arguments`` (``MegatronLayout`` arguments, ``order``
    ignored), best first: fewest kept kinds crossing, then fewest crossing groups.

    Orders the release refuses (e.g. one not ending in ``pp`` when the dense and expert
    data-parallel sizes differ) are left out; orders building the same layout are merged into
    the first one's ``same_as``. An empty list means the release accepts no order at all.
    """
    seen: dict[tuple, tuple[MegatronLayout, list[str]]] = {}
    for order in candidate_orders():
        try:
            layout = MegatronLayout(**{**layout_arguments, "order": order})
        except (RuntimeError, AssertionError, KeyError, ValueError, TypeError):
            continue
        key = _effective(layout)
        if key in seen:
            seen[key][1].append(order)
        else:
            seen[key] = (layout, [])
    scored = [score_layout(layout, domains, keep_inside, same) for layout, same in seen.values()]
    return sorted(scored, key=lambda c: c.rank_key)  # stable: the default order wins ties


def _group_size(layout: MegatronLayout, kind: str) -> int:
    groups = layout.enumerate(kind)
    return len(groups[0]) if groups else 0


def why_crossing(layout: MegatronLayout, domains: NvlinkDomains, kinds: Sequence[str]) -> list[str]:
    """For each of ``kinds`` that no order can keep inside a domain on its own, the reason.

    A group larger than a domain's ranks always crosses; so does some group of a size that does
    not divide the domain's ranks (or the ranks of a partial last domain), because the groups of
    a kind partition the layout's ranks.
    """
    per = domains.ranks_per_domain
    first = layout.rank_offset
    world = layout.layout_world_size
    reasons = []
    for kind in kinds:
        if kind not in layout.kinds():
            continue
        size = _group_size(layout, kind)
        if size > per:
            reasons.append(f"{kind} groups have {size} ranks, more than the {per} ranks of a domain")
            continue
        # the ranks of the layout in each domain it touches
        counts: dict[int, int] = {}
        for rank in range(first, first + world):
            counts[domains.domain_of(rank)] = counts.get(domains.domain_of(rank), 0) + 1
        odd = sorted({c for c in counts.values() if c % size})
        if size > 1 and odd:
            reasons.append(
                f"{kind} groups have {size} ranks, which does not divide the {odd[0]} ranks the layout has "
                f"in some domain"
            )
    return reasons


def suggest_fill(
    layout_arguments: Mapping[str, Any], domains: NvlinkDomains, keep_inside: Sequence[str], step: int = 1
) -> tuple[int, OrderCandidate] | None:
    """The most GPUs per domain to use (a multiple of ``step``, at most the domain size) for which
    some accepted order keeps every kind of ``keep_inside`` inside a domain, with that order;
    ``None`` when no fill does (e.g. a group larger than a domain).

    Leaving GPUs of each domain unused (64 of 72) is the fix when group sizes do not divide the
    domain size; the world then spans more domains.
    """
    try:
        layout = MegatronLayout(**layout_arguments)
    except (RuntimeError, AssertionError, KeyError, ValueError, TypeError):
        return None
    # a kind's group size is the same under every order; a used count it does not divide fails
    sizes = {_group_size(layout, k) for k in keep_inside if k in layout.kinds()}
    for used in range(domains.domain_size - domains.domain_size % step, 0, -step):
        if any(size > used for size in sizes):
            return None  # fewer GPUs per domain only makes it worse
        if any(used % size for size in sizes):
            continue
        candidates = suggest_orders(layout_arguments, NvlinkDomains(domains.domain_size, used), keep_inside)
        if candidates and not candidates[0].crossing_kinds:
            return used, candidates[0]
    return None


# --------------------------------------------------------------------------- topologies
def _spans(placements: Sequence[ModulePlacement]) -> list[tuple[range, list[ModulePlacement]]]:
    spans: dict[tuple[int, int], list[ModulePlacement]] = {}
    for p in placements:
        spans.setdefault((p.ranks.start, p.ranks.stop), []).append(p)
    return [(range(*key), members) for key, members in sorted(spans.items())]


def suggest_placements(
    placements: Sequence[ModulePlacement],
    domains: NvlinkDomains,
    keep_inside: Sequence[str],
    *,
    series: str,
    limit: int = 10,
) -> list[dict[str, Any]]:
    """Arrangements of a topology's module spans along the rank axis, best first.

    Each arrangement moves whole spans (colocated modules move together) to new rank offsets;
    every module gets its best order there (:func:`suggest_orders`). An arrangement's score is
    the sum over its modules of their best candidate's key. Returns up to ``limit`` entries
    ``{"spans": [...], "modules": {name: {"ranks": [start, stop], **candidate}}, "crossing_kinds":
    [...], "crossing_groups": n}``. Topologies with more than :data:`MAX_MODULE_SPANS` spans keep
    their arrangement (only orders are suggested).
    """
    spans = _spans(placements)
    world = sum(len(r) for r, _ in spans)
    arrangements = (
        itertools.permutations(range(len(spans))) if len(spans) <= MAX_MODULE_SPANS else [tuple(range(len(spans)))]
    )
    best_at: dict[tuple[str, int], OrderCandidate | None] = {}
    results: list[dict[str, Any]] = []
    for arrangement in arrangements:
        start = 0
        chosen: dict[str, tuple[list[int], OrderCandidate]] = {}
        specs = []
        for index in arrangement:
            span, members = spans[index]
            for p in members:
                key = (p.name, start)
                if key not in best_at:
                    best_at[key] = _best_for_module(p, start, world, domains, keep_inside)
                candidate = best_at[key]
                if candidate is None:
                    break
                specs.append(replace(p.spec, ranks=(start, start + len(span)), order=candidate.order))
                chosen[p.name] = ([start, start + len(span)], candidate)
            start += len(span)
        if len(chosen) != len(placements):
            continue  # some module has no accepted order at its new offset
        try:
            validate_topology(specs, world, series)
        except TopologySpecError:
            continue
        results.append(
            {
                "spans": [[spans[i][0].start, spans[i][0].stop] for i in arrangement],
                "modules": {n: {"ranks": r, **c.as_dict()} for n, (r, c) in chosen.items()},
                "crossing_kinds": sorted({f"{n}:{k}" for n, (_, c) in chosen.items() for k in c.crossing_kinds}),
                "crossing_groups": sum(sum(c.crossing.values()) for _, c in chosen.values()),
            }
        )
    results.sort(key=lambda r: (len(r["crossing_kinds"]), r["crossing_groups"]))
    return results[:limit]


def _best_for_module(
    placement: ModulePlacement, start: int, world: int, domains: NvlinkDomains, keep_inside: Sequence[str]
) -> OrderCandidate | None:
    lay = placement.layout
    arguments: dict[str, Any] = {
        "world_size": world,
        "tensor_model_parallel_size": lay.tensor_model_parallel_size,
        "pipeline_model_parallel_size": lay.pipeline_model_parallel_size,
        "context_parallel_size": lay.context_parallel_size,
        "expert_model_parallel_size": lay.expert_model_parallel_size,
        "expert_tensor_parallel_size": lay.expert_tensor_parallel_size,
        "release": lay.release,
    }
    if len(placement.ranks) != world:
        arguments.update(rank_offset=start, local_world_size=len(placement.ranks))
    candidates = suggest_orders(arguments, domains, keep_inside)
    return candidates[0] if candidates else None
