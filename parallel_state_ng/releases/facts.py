"""What each Megatron-Core release series does, as one typed object per series.

Every behaviour that differs between releases without being a signature difference (those
are in :mod:`.parallel_state` and :mod:`.hyper_comm_grid`) is one boolean attribute of
:class:`ReleaseFacts`, read by attribute (``release_facts("0.19").gtp_remat_axis``). The values
come from one table, :data:`FACT_RANGES`: the first series that has the behaviour and the last
one (``None``: still in the newest supported series). Read from each release's
``megatron/core/parallel_state.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from parallel_state_ng.releases import SUPPORTED_SERIES, Release, as_release

__all__ = ["ReleaseFacts", "FACT_RANGES", "release_facts"]

#: fact -> (first series with it, last series with it or ``None`` for "still").
FACT_RANGES: dict[str, tuple[str, str | None]] = {
    # -- the layout initialize_model_parallel builds
    "encoder_decoder": ("0.12", "0.13"),
    "dp_before_dp_cp": ("0.12", "0.12"),
    "inter_partial_dp": ("0.12", "0.12"),
    "hcp_sizes_checked": ("0.13", None),
    "partial_expert_dp": ("0.13", None),
    "dist_opt_instance_group": ("0.13", None),
    "rank_offset": ("0.17", None),
    "all_gather_group_in_init": ("0.16", "0.17"),
    "all_gather_groups_function": ("0.18", None),
    "hybrid_context_parallel": ("0.16", None),
    "gtp_remat_axis": ("0.19", None),
    "gtp_requires_single_instance": ("0.19", None),
    # -- group options
    "expert_group_timeout": ("0.16", None),
    "hierarchical_cp_default_timeout": ("0.12", "0.12"),
    "sharp_collnet_zero": ("0.12", "0.13"),
    "sharp_dp_unusable": ("0.19", None),
    "nccl_config_defaults": ("0.12", "0.12"),
    # -- getters, setters and destroy
    "all_ranks_with_gtp": ("0.19", None),
    "data_parallel_partial_check_first": ("0.19", None),
    "pipeline_rank_reads_world_rank": ("0.12", "0.13"),
    "virtual_stage_from_global": ("0.12", "0.12"),
    "virtual_rank_setter_warns": ("0.13", None),
    "encoder_deprecation_warnings": ("0.13", "0.13"),
    "symmetric_memory_manager_destroy": ("0.17", None),
    "nccl_ep_finalize_on_destroy": ("0.19", None),
}


@dataclass(frozen=True)
class ReleaseFacts:
    """The behaviour of one release series (``series``); every other attribute is a bool.

    Layout:
        encoder_decoder: ``encoder_tensor_model_parallel_size`` /
            ``encoder_pipeline_model_parallel_size`` and ``pipeline_model_parallel_split_rank``
            exist: an encoder block of ranks ``[0, encoder world)`` with its own rank generator,
            the decoder and expert generators offset after it, pipelines stitched across both.
        dp_before_dp_cp: the data-parallel groups are created before the dp × cp ones (later
            the dp × cp groups come first, for SHARP).
        inter_partial_dp: several distributed-optimizer instances build the groups across the
            instances' dp × cp shares (later releases build the expert ones instead).
        hcp_sizes_checked: ``hierarchical_context_parallel_sizes`` must multiply to the
            context-parallel size (``AssertionError``); before, a level whose groups do not fit
            leaves the ranks past the last whole group without a group at that level.
        partial_expert_dp: several distributed-optimizer instances build the intra/inter
            partial expert-data-parallel groups.
        dist_opt_instance_group: the intra-distributed-optimizer-instance group is built.
        rank_offset: ``rank_offset`` / ``local_world_size`` exist: the layout covers
            ``[rank_offset, rank_offset + local_world_size)``.
        all_gather_group_in_init: ``initialize_model_parallel(create_all_gather_group=True)``
            builds the all-gather twin of the dp × cp group (same ranks).
        all_gather_groups_function: ``create_all_gather_groups()`` builds the all-gather groups
            after init from a rank generator of its own (default order, offset 0, sizes read
            back from the getters).
        hybrid_context_parallel: ``hybrid_context_parallel=True`` builds power-of-two chunks of
            each dp × cp group (``HYBRID_DP_CP_GROUP_<size>``).
        gtp_remat_axis: the GTP weight-rematerialization axis exists (``gtp_remat`` injected
            after ``tp`` in the dense generator and after ``ep`` in the expert one).
        gtp_requires_single_instance: GTP sizes > 1 with several distributed-optimizer
            instances are rejected (``AssertionError``).

    Group options:
        expert_group_timeout: the expert-model-parallel group gets the init timeout (before:
            torch's default).
        hierarchical_cp_default_timeout: the hierarchical context-parallel groups get torch's
            default timeout, not the init's.
        sharp_collnet_zero: SHARP leaves ``NCCL_COLLNET_ENABLE`` alone before the dp × cp group
            and sets it to ``"0"`` after its barrier (later: ``"1"`` before, removed after).
        sharp_dp_unusable: ``use_sharp`` with ``sharp_enabled_group="dp"`` fails in init
            (``AssertionError``: its barrier reads a global set only later).
        nccl_config_defaults: a group named in the NCCL communicator config gets
            ``cga_cluster_size`` 4, ``max_ctas`` 32 and ``min_ctas`` 1 where the file leaves them
            out, and the file's ``is_high_priority_stream`` is ignored (later: NCCL's defaults,
            and the flag is read).

    Getters, setters and destroy:
        all_ranks_with_gtp: ``get_all_ranks()`` joins tp, gtp_remat, dp (spanning GTP), cp, pp,
            ep ranks (before: tp, dp, cp, pp, ep).
        data_parallel_partial_check_first: ``get_data_parallel_group`` asserts "partial needs
            context parallel" before "initialized".
        pipeline_rank_reads_world_rank: ``get_pipeline_model_parallel_rank()`` reads
            ``torch.distributed.get_rank()`` before the group.
        virtual_stage_from_global: ``is_pipeline_first/last_stage`` compare the global virtual
            pipeline rank (no ``vp_stage`` parameter).
        virtual_rank_setter_warns: ``set_virtual_pipeline_model_parallel_rank`` warns
            (``DeprecationWarning``).
        encoder_deprecation_warnings: encoder sizes and the encoder/split-rank functions warn
            (``DeprecationWarning``).
        symmetric_memory_manager_destroy: ``destroy_model_parallel`` clears
            ``megatron.core.inference.symmetric_memory.SymmetricMemoryManager``.
        nccl_ep_finalize_on_destroy: ``destroy_model_parallel`` first calls
            ``megatron.core.transformer.moe.fused_a2a.nccl_ep_finalize`` (errors ignored).
    """

    series: str
    encoder_decoder: bool
    dp_before_dp_cp: bool
    inter_partial_dp: bool
    hcp_sizes_checked: bool
    partial_expert_dp: bool
    dist_opt_instance_group: bool
    rank_offset: bool
    all_gather_group_in_init: bool
    all_gather_groups_function: bool
    hybrid_context_parallel: bool
    gtp_remat_axis: bool
    gtp_requires_single_instance: bool
    expert_group_timeout: bool
    hierarchical_cp_default_timeout: bool
    sharp_collnet_zero: bool
    sharp_dp_unusable: bool
    nccl_config_defaults: bool
    all_ranks_with_gtp: bool
    data_parallel_partial_check_first: bool
    pipeline_rank_reads_world_rank: bool
    virtual_stage_from_global: bool
    virtual_rank_setter_warns: bool
    encoder_deprecation_warnings: bool
    symmetric_memory_manager_destroy: bool
    nccl_ep_finalize_on_destroy: bool

    @property
    def all_ranks_kinds(self) -> tuple[str, ...]:
        """The group kinds whose in-group ranks ``get_all_ranks()`` joins with ``"_"``, in order."""
        if self.all_ranks_with_gtp:
            return ("tp", "gtp_remat", "gtp_remat_dp", "cp", "pp", "ep")
        return ("tp", "dp", "cp", "pp", "ep")


_FIELDS = [f.name for f in dataclasses.fields(ReleaseFacts) if f.name != "series"]
if set(_FIELDS) != set(FACT_RANGES):  # the table and the class state the same facts
    raise ImportError(f"FACT_RANGES and ReleaseFacts differ: {sorted(set(_FIELDS) ^ set(FACT_RANGES))}")


def _in_range(release: Release, first: str, last: str | None) -> bool:
    return release.at_least(first) and (last is None or not release.after(last))


@functools.cache
def _facts_of_series(series: str) -> ReleaseFacts:
    release = as_release(series)
    return ReleaseFacts(series=series, **{name: _in_range(release, *FACT_RANGES[name]) for name in _FIELDS})


def release_facts(release: str | Release) -> ReleaseFacts:
    """The :class:`ReleaseFacts` of ``release`` (``"0.19"``, ``"0.19.2"`` or a :class:`Release`).

    Raises:
        ValueError: ``release`` is not a supported series (the message names them).
    """
    series = as_release(release).series
    if series not in SUPPORTED_SERIES:
        raise ValueError(f"release {release!s} has no release facts; supported series: {', '.join(SUPPORTED_SERIES)}")
    return _facts_of_series(series)
