"""Per-release facts about the rank layout ``initialize_model_parallel`` builds.

Read from each release's ``megatron/core/parallel_state.py`` (``RankGenerator``,
``initialize_model_parallel``, ``create_all_gather_groups``). The group arithmetic
(``generate_masked_orthogonal_rank_groups``, hierarchical and hybrid groups, embedding
defaults) is the same in every supported release; what moves is which groups exist, a few
parameters of the rank generators, and (0.12–0.13) a third generator for an encoder. :class:`~parallel_state_ng.mcore.layout.MegatronLayout`
reads these facts; it never compares version strings itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from parallel_state_ng.mcore.releases import SUPPORTED_SERIES, parse_release

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
        encoder_decoder: ``encoder_tensor_model_parallel_size`` /
            ``encoder_pipeline_model_parallel_size`` and ``pipeline_model_parallel_split_rank``
            exist (0.12–0.13): an encoder block of ranks ``[0, encoder world)`` with a rank
            generator of its own (expert size 1), the decoder and expert generators offset
            after it, pipeline groups stitched from an encoder and a decoder pipeline (an
            encoder rank can be in several), model-parallel groups concatenated, every other
            kind's groups listed encoder first.
        inter_partial_dp: with several distributed-optimizer instances, the groups across
            the instances' dp × cp shares are built (``INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``,
            0.12); later releases build the expert ones instead.
        partial_expert_dp: with several distributed-optimizer instances, the intra/inter
            partial expert-data-parallel groups are built (0.13+).
        dist_opt_instance_group: the intra-distributed-optimizer-instance group is built
            (0.13+).
        dp_before_dp_cp: the data-parallel groups are created before the dp × cp ones (0.12;
            later the dp × cp groups come first, for SHARP).
        hcp_sizes_checked: ``hierarchical_context_parallel_sizes`` must multiply to the
            context-parallel size (``AssertionError``; 0.13+). 0.12 takes any sizes: a level
            whose groups do not fit the context-parallel group leaves the ranks past the last
            whole group without a group at that level.
    """

    series: str
    hybrid_dp_cp: bool
    all_gather_in_init: bool
    all_gather_groups_function: bool
    rank_offset: bool
    gtp_remat_axis: bool
    gtp_requires_single_instance: bool
    all_ranks_kinds: tuple[str, ...]
    encoder_decoder: bool
    inter_partial_dp: bool
    partial_expert_dp: bool
    dist_opt_instance_group: bool
    dp_before_dp_cp: bool
    hcp_sizes_checked: bool


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
        encoder_decoder=r.before("0.14"),
        inter_partial_dp=r.before("0.13"),
        partial_expert_dp=r.at_least("0.13"),
        dist_opt_instance_group=r.at_least("0.13"),
        dp_before_dp_cp=r.before("0.13"),
        hcp_sizes_checked=r.at_least("0.13"),
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
