"""Argument checks of :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`.

:func:`check_layout_arguments` rejects the arguments a layout's release does not have and bad
sizes or offsets, with MCore's exception types; :func:`check_split_rank` a 0.12/0.13 split rank
outside the pipeline; :func:`checked_embedding_ranks` checks what a user's
``get_embedding_ranks`` / ``get_position_embedding_ranks`` returns. Pure checks: they raise or
return, and change nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from parallel_state_ng.layout.bounded_input import MAX_RANK
from parallel_state_ng.layout.order import EmptyGroupError
from parallel_state_ng.layout.shape_checks import check_int
from parallel_state_ng.layout.validate import _check_size
from parallel_state_ng.releases.facts import ReleaseFacts

__all__ = [
    "check_layout_arguments",
    "check_rank_offset",
    "check_split_rank",
    "checked_embedding_ranks",
    "LayoutArguments",
]


class LayoutArguments(Protocol):
    """What the checks read of a :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`.

    Stated here, not imported, because the layout runs these checks while it is made.
    """

    facts: ReleaseFacts
    release: str | None
    world_size: int
    rank_offset: int
    local_world_size: int | None

    @property
    def layout_world_size(self) -> int:
        """The number of ranks the layout covers."""

    gtp_remat_size: int
    expert_gtp_remat_size: int
    encoder_tensor_model_parallel_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int | None
    num_distributed_optimizer_instances: int
    encoder_pipeline_model_parallel_size: int | None
    pipeline_model_parallel_split_rank: int | None
    get_embedding_ranks: Callable | None
    get_position_embedding_ranks: Callable | None


def check_layout_arguments(layout: LayoutArguments) -> None:
    """Reject arguments ``layout``'s release (``layout.facts``, already resolved) does not have,
    and bad offsets or sizes.

    Raises:
        TypeError: an argument the release lacks, or a split rank that is not an int.
        ValueError: the covered ranks end past ``world_size``; a size or offset out of range.
    """
    _check_no_offset(layout)
    legacy = (
        layout.encoder_tensor_model_parallel_size,
        layout.encoder_pipeline_model_parallel_size,
        layout.pipeline_model_parallel_split_rank,
    )
    if not layout.facts.encoder_decoder and legacy != (0, 0, None):
        raise TypeError(
            f"megatron-core {layout.release} has no encoder_tensor_model_parallel_size / encoder_pipeline_model_"
            f"parallel_size / pipeline_model_parallel_split_rank (removed in 0.14); got {legacy}"
        )
    check_int(layout.encoder_tensor_model_parallel_size, "encoder_tensor_model_parallel_size", minimum=0)
    if layout.encoder_pipeline_model_parallel_size is not None:
        check_int(layout.encoder_pipeline_model_parallel_size, "encoder_pipeline_model_parallel_size", minimum=0)
    split = layout.pipeline_model_parallel_split_rank
    if split is not None and (isinstance(split, bool) or not isinstance(split, int)):
        raise TypeError(f"pipeline_model_parallel_split_rank must be an int or None, got {split!r}")
    if not layout.facts.gtp_remat_axis and (layout.gtp_remat_size != 1 or layout.expert_gtp_remat_size != 1):
        raise TypeError(
            f"megatron-core {layout.release} has no gtp_remat_size / expert_gtp_remat_size (added in 0.19); "
            f"got gtp_remat_size={layout.gtp_remat_size!r}, expert_gtp_remat_size={layout.expert_gtp_remat_size!r}"
        )
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "num_distributed_optimizer_instances",
    ):  # a zero size is MCore's ZeroDivisionError, named here
        _check_size(name, getattr(layout, name))
    if layout.expert_tensor_parallel_size is not None:
        _check_size("expert_tensor_parallel_size", layout.expert_tensor_parallel_size)
    check_int(layout.world_size, "world_size", minimum=1)
    check_int(layout.rank_offset, "rank_offset", minimum=0)
    check_int(layout.gtp_remat_size, "gtp_remat_size", minimum=1)
    check_int(layout.expert_gtp_remat_size, "expert_gtp_remat_size", minimum=1)
    if layout.local_world_size is not None:
        check_int(layout.local_world_size, "local_world_size", minimum=1)
    if layout.world_size > MAX_RANK:
        raise ValueError(f"world_size {layout.world_size} is over the limit of {MAX_RANK} (2**62) ranks")
    _check_end(layout)


def check_rank_offset(layout: LayoutArguments) -> None:
    """The checks of :func:`check_layout_arguments` that read ``rank_offset``, in its order.

    For a layout whose other arguments passed :func:`check_layout_arguments` and whose offset
    then changed (``MegatronLayout.shifted``): same exceptions, same messages.
    """
    _check_no_offset(layout)
    check_int(layout.rank_offset, "rank_offset", minimum=0)
    _check_end(layout)


def _check_no_offset(layout: LayoutArguments) -> None:
    if not layout.facts.rank_offset and (layout.rank_offset != 0 or layout.local_world_size is not None):
        raise TypeError(
            f"megatron-core {layout.release} has no rank_offset / local_world_size (added in 0.17); "
            f"got rank_offset={layout.rank_offset!r}, local_world_size={layout.local_world_size!r}"
        )


def _check_end(layout: LayoutArguments) -> None:
    end = layout.rank_offset + layout.layout_world_size
    if end > layout.world_size:
        # MCore would hand ranks >= world_size to new_group, which raises ValueError.
        raise ValueError(
            f"rank_offset ({layout.rank_offset}) + local_world_size ({layout.layout_world_size}) = {end} "
            f"exceeds world_size ({layout.world_size})"
        )


def check_split_rank(layout: LayoutArguments, stages: int) -> None:
    """Reject a ``pipeline_model_parallel_split_rank`` outside a pipeline of ``stages`` stages
    when a default embedding callable will index the pipeline with it.

    Raises:
        IndexError: the split rank is not in ``[-stages, stages)``.
    """
    split = layout.pipeline_model_parallel_split_rank
    if split is not None and (layout.get_embedding_ranks is None or layout.get_position_embedding_ranks is None):
        if not -stages <= split < stages:  # MCore's default embedding ranks index the pipeline with it
            raise IndexError(f"pipeline_model_parallel_split_rank ({split}) is outside the pipeline of {stages} stages")


def checked_embedding_ranks(fn: Callable, arg: str, pp_ranks: Sequence[int]) -> list[int]:
    """``fn(list(pp_ranks))`` as a list of ranks, checked: non-empty and a subset of ``pp_ranks``.

    ``arg`` names the callable in the messages (``get_embedding_ranks`` /
    ``get_position_embedding_ranks``).

    Raises:
        TypeError: ``fn`` returned something that is not a list of ranks.
        EmptyGroupError: ``fn`` returned no ranks.
        ValueError: ``fn`` returned ranks outside ``pp_ranks``.
    """
    result = fn(list(pp_ranks))
    try:
        members = list(result)
    except TypeError:
        raise TypeError(f"{arg} must return a list of ranks, got {result!r}") from None
    if not members:
        # MCore hands the empty list to new_group, which fails with TypeError.
        raise EmptyGroupError(f"{arg} returned no ranks for the pipeline group {list(pp_ranks)}")
    outside = [r for r in members if r not in pp_ranks]
    if outside:
        raise ValueError(
            f"{arg} returned ranks {outside} that are not in the pipeline group {list(pp_ranks)}; "
            f"it must return a subset of the ranks it is given"
        )
    return members
