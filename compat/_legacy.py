"""Functions of ``compat.parallel_state`` that only the encoder/decoder era (0.12–0.13) has.

The pipeline split rank (``pipeline_model_parallel_split_rank``), the encoder/decoder stage
predicates, 0.12's inter-partial data-parallel getter, MoE logging tracker and hierarchical
group helper. One implementation each, reading the module globals as MCore's do;
``compat._surface`` serves them only for the releases that have them. 0.13 deprecates the
encoder functions with a ``DeprecationWarning`` (:data:`BEHAVIOUR` ``encoder_deprecation_warnings``).
"""

from __future__ import annotations

import warnings

from parallel_state_ng.layout.kinds import GROUP_KINDS
from parallel_state_ng.layout.order import hierarchical_group

from ._getters import required
from ._helpers import _note_group_creation, member_group
from ._namespace import facade as ps
from ._release import FACTS

__all__: list[str] = []  # served through compat.parallel_state

_WARN = FACTS.encoder_deprecation_warnings


def _deprecated(what: str) -> None:
    if _WARN:
        warnings.warn(
            f"{what} belongs to the encoder-specific pipeline parallelism that megatron-core deprecates "
            f"(removed in 0.14): model encoder and decoder with separate grids instead",
            DeprecationWarning,
            stacklevel=3,
        )


def set_pipeline_model_parallel_split_rank(rank):
    """Set the pipeline stage where the decoder starts (deprecated split rank)."""
    ps._PIPELINE_MODEL_PARALLEL_SPLIT_RANK = rank


def get_pipeline_model_parallel_split_rank():
    """The pipeline split rank (``None`` when not set)."""
    return ps._PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def _stage(rank: int | None) -> int | None:
    """``rank``, or this rank's stage; ``None`` when the pipeline has one stage."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_pipeline_model_parallel_rank() if rank is None else rank


def is_pipeline_stage_before_split(rank=None):
    """Whether pipeline stage ``rank`` (default: this rank's) runs the encoder: before the split rank."""
    _deprecated("is_pipeline_stage_before_split")
    stage = _stage(rank)
    split = ps._PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    return stage is None or split is None or stage < split


def is_pipeline_stage_after_split(rank=None):
    """Whether pipeline stage ``rank`` (default: this rank's) runs the decoder: at or after the split rank."""
    _deprecated("is_pipeline_stage_after_split")
    stage = _stage(rank)
    split = ps._PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    return stage is None or split is None or stage >= split


def is_inside_encoder(rank=None) -> bool:
    """Whether pipeline stage ``rank`` (default: this rank's) holds encoder layers.

    Without an encoder block the encoder shares the first stage with the decoder.
    """
    _deprecated("is_inside_encoder")
    stage = _stage(rank)
    start = ps._PIPELINE_MODEL_PARALLEL_DECODER_START
    if stage is None:
        return True
    return stage == 0 if start is None else stage < start


def is_inside_decoder(rank=None) -> bool:
    """Whether pipeline stage ``rank`` (default: this rank's) holds decoder layers."""
    _deprecated("is_inside_decoder")
    stage = _stage(rank)
    start = ps._PIPELINE_MODEL_PARALLEL_DECODER_START
    return stage is None or start is None or stage >= start


def get_pipeline_model_parallel_decoder_start() -> int | None:
    """The first decoder stage when the pipeline starts with an encoder block (else ``None``)."""
    _deprecated("get_pipeline_model_parallel_decoder_start")
    return ps._PIPELINE_MODEL_PARALLEL_DECODER_START


def is_pipeline_stage_at_split():
    """Whether this stage is the last before the split rank (the next one is after it)."""
    _deprecated("is_pipeline_stage_at_split")
    stage = ps.get_pipeline_model_parallel_rank()
    return ps.is_pipeline_stage_before_split(stage) and ps.is_pipeline_stage_after_split(stage + 1)


def get_inter_partial_data_parallel_group():
    """This rank's group across the distributed-optimizer instances' dp × cp shares (0.12)."""
    return required(ps._INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, "Inter partial data parallel group")


def get_moe_layer_wise_logging_tracker():
    """The module's MoE layer-wise logging tracker (a dict; reset by ``destroy_model_parallel``)."""
    return ps._MOE_LAYER_WISE_LOGGING_TRACKER


def create_hierarchical_parallel_groups(rank, ranks, group_size, hierarchical_group_sizes, pg_options):
    """Create ``rank``'s hierarchical sub-groups of the first ``group_size`` of ``ranks``; return them.

    Level ``l`` groups ``hierarchical_group_sizes[l]`` ranks; the groups of one level tile
    whole blocks of ``ranks`` (0.12 takes sizes that do not tile the group: a rank past the
    last whole block has no group at that level). Only the calling rank's groups are created;
    they get torch's default timeout, as in 0.12.

    Raises:
        IndexError: ``group_size`` exceeds ``len(ranks)``.
    """
    sizes = list(hierarchical_group_sizes)
    if group_size > len(ranks):
        raise IndexError(f"group_size ({group_size}) exceeds the {len(ranks)} ranks given")
    members_of = list(ranks)[:group_size]
    if sizes and members_of:
        _note_group_creation()
    if rank not in members_of:
        return []
    groups = []
    for level in range(len(sizes)):
        members = hierarchical_group(members_of, rank, sizes, level)
        if members is not None:
            groups.append(
                member_group(members, pg_options=pg_options, group_desc=GROUP_KINDS["hcp"].desc.format(level=level))
            )
    return groups
