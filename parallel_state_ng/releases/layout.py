"""Per-release facts about the rank layout ``initialize_model_parallel`` builds.

Read from each release's ``megatron/core/parallel_state.py`` (``RankGenerator``,
``initialize_model_parallel``, ``create_all_gather_groups``). The group arithmetic
(``generate_masked_orthogonal_rank_groups``, hierarchical and hybrid groups, embedding
defaults) is the same in every supported release; what moves is which groups exist and a few
parameters of the two rank generators. :class:`~parallel_state_ng.megatron_layout.MegatronLayout`
reads these facts; it never compares version strings itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import SUPPORTED_SERIES, parse_release

__all__ = ["LayoutFacts", "LAYOUT_FACTS", "layout_facts"]


@dataclass(frozen=True)
class LayoutFacts:
    """What one release series' ``initialize_model_parallel`` does to the layout.

    Attributes:
        series: ``"major.minor"``.
        hybrid_dp_cp: ``hybrid_context_parallel`` exists (power-of-two chunks of each dp-cp
            group, ``HYBRID_DP_CP_GROUP_<size>``).
        all_gather_in_init: ``create_all_gather_group`` is an init argument; the
            ``DATA_PARALLEL_GROUP_WITH_CP_AG`` group then has the ranks of the dp-cp group.
        all_gather_groups_function: ``create_all_gather_groups()`` builds the all-gather
            groups after init, from a rank generator of its own: the default order
            ``tp-cp-ep-dp-pp``, rank offset 0, sizes read back from the getters (so the data
            parallel size includes the GTP axis where the getter's default does).
        rank_offset: ``initialize_model_parallel(rank_offset=, local_world_size=)`` exist: the
            layout covers ``[rank_offset, rank_offset + local_world_size)`` and both rank
            generators are offset.
        gtp_remat_axis: the GTP weight-rematerialization axis exists
            (``gtp_remat_size`` / ``expert_gtp_remat_size``); the token ``gtp_remat`` is
            injected into the order after ``tp`` (dense generator) and after ``ep`` (expert
            generator), and the model-parallel, tp-dp and tp-dp-cp groups span it.
        gtp_requires_single_instance: GTP sizes > 1 with more than one distributed-optimizer
            instance are rejected (``AssertionError``).
        all_ranks_kinds: the group kinds whose in-group ranks ``get_all_ranks()`` joins with
            ``"_"``, in its order (0.19 adds the GTP rank and its default data-parallel rank
            spans the GTP axis).
    """

    series: str
    hybrid_dp_cp: bool
    all_gather_in_init: bool
    all_gather_groups_function: bool
    rank_offset: bool
    gtp_remat_axis: bool
    gtp_requires_single_instance: bool
    all_ranks_kinds: tuple[str, ...]


def _facts(series: str) -> LayoutFacts:
    r = parse_release(series)
    return LayoutFacts(
        series=series,
        hybrid_dp_cp=r.at_least("0.16"),
        all_gather_in_init=r.at_least("0.16") and r.before("0.18"),
        all_gather_groups_function=r.at_least("0.18"),
        rank_offset=r.at_least("0.17"),
        gtp_remat_axis=r.at_least("0.19"),
        gtp_requires_single_instance=r.at_least("0.19"),
        all_ranks_kinds=(
            ("tp", "gtp_remat", "gtp_remat_dp", "cp", "pp", "ep") if r.at_least("0.19") else ("tp", "dp", "cp", "pp", "ep")
        ),
    )


LAYOUT_FACTS: dict[str, LayoutFacts] = {s: _facts(s) for s in SUPPORTED_SERIES}


@functools.lru_cache(maxsize=64)
def layout_facts(release: str) -> LayoutFacts:
    """The :class:`LayoutFacts` of ``release`` (``"0.19"`` or ``"0.19.2"``).

    Raises:
        ValueError: ``release`` is not a supported series (names the supported ones).
    """
    series = parse_release(release).series
    try:
        return LAYOUT_FACTS[series]
    except KeyError:
        raise ValueError(
            f"release {release!r} has no layout facts; supported series: {', '.join(SUPPORTED_SERIES)}"
        ) from None
