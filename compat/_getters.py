"""Dense-layer accessors of ``compat.parallel_state``: group getters, sizes, ranks, pipeline
stages, setters — one implementation each, reading the module globals as MCore's do.

Each takes the union of the parameters any release has; a parameter a release lacks has the
default that means what that release does (``with_gtp_remat=False``: before 0.19 the data-
parallel getters return the replicate group). ``compat._surface`` serves each release's exact
signature on top.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

from parallel_state_ng.releases import parallel_state as api

from ._namespace import facade as ps
from ._release import FACTS, RELEASE

__all__: list[str] = []  # served through compat.parallel_state

_PARTIAL_CHECK_FIRST = FACTS.data_parallel_partial_check_first
# 0.12: the first/last-stage checks read the global virtual pipeline rank (no vp_stage).
_STAGE_FROM_GLOBAL = FACTS.virtual_stage_from_global
_SETTER_WARNS = FACTS.virtual_rank_setter_warns
_RANK_FIRST = FACTS.pipeline_rank_reads_world_rank
# Whether the served release's data-parallel getters take with_gtp_remat (0.19).
# (Every release has get_data_parallel_group: its signature is never None.)
_GTP_PARAMETER = "with_gtp_remat" in dict(
    cast("tuple[api.Param, ...]", api.signature("get_data_parallel_group", RELEASE))
)


def gtp_keyword(with_gtp_remat: bool) -> dict[str, bool]:
    """``with_gtp_remat`` as a keyword for the served functions, where the release has it.

    Internal calls go through the module (``ps.get_...``) as MCore's do, so a getter patched on
    ``compat.parallel_state`` is seen by the getters built on it.
    """
    return {"with_gtp_remat": with_gtp_remat} if _GTP_PARAMETER else {}


@functools.cache
def _served_parameters(function: str) -> frozenset[str]:
    return frozenset(dict(api.signature(function, RELEASE) or ()))


def served_keywords(function: str, **kwargs: Any) -> dict[str, Any]:
    """``kwargs`` limited to the parameters the served release's ``function`` has.

    For calls of one served function from another: a parameter the release lacks (e.g.
    ``vp_stage`` on 0.12) is at its default in the caller, which is what that release does.
    """
    accepted = _served_parameters(function)
    return {name: value for name, value in kwargs.items() if name in accepted}


def required(value: Any, what: str) -> Any:
    """``value``, or ``AssertionError`` naming ``what`` as not initialized."""
    if value is None:
        raise AssertionError(f"{what} is not initialized")
    return value


def checked(value: Any, check_initialized: bool, what: str) -> Any:
    """``value``; with ``check_initialized`` it must not be ``None``."""
    return required(value, what) if check_initialized else value


def distributed() -> bool:
    """Whether torch.distributed is available and initialized."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_initialized():
    """Whether ``initialize_model_parallel`` has run (the data-parallel group exists)."""
    return ps._DATA_PARALLEL_GROUP is not None


def is_unitialized() -> bool:
    """Deprecated inverse of ``is_initialized``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=1)
    return not ps.is_initialized()


def model_parallel_is_initialized():
    """Whether the tensor, pipeline and data-parallel groups all exist."""
    return not (
        ps._TENSOR_MODEL_PARALLEL_GROUP is None
        or ps._PIPELINE_MODEL_PARALLEL_GROUP is None
        or ps._DATA_PARALLEL_GROUP is None
    )


# --------------------------------------------------------------------------- group getters
def get_model_parallel_group(check_initialized=True):
    """This rank's model-parallel (tp × pp; 0.19: × gtp_remat) group."""
    return checked(ps._MODEL_PARALLEL_GROUP, check_initialized, "model parallel group")


def get_tensor_model_parallel_group(check_initialized=True):
    """This rank's tensor-model-parallel group."""
    return checked(ps._TENSOR_MODEL_PARALLEL_GROUP, check_initialized, "tensor model parallel group")


def get_pipeline_model_parallel_group(check_initialized=True):
    """This rank's pipeline-model-parallel group."""
    return checked(ps._PIPELINE_MODEL_PARALLEL_GROUP, check_initialized, "pipeline_model parallel group")


def get_data_parallel_group(
    with_context_parallel=False, with_gtp_remat=False, partial_data_parallel=False, independent_all_gather=False
):
    """This rank's data-parallel group.

    ``with_context_parallel``: dp × cp; ``partial_data_parallel`` (needs cp): the share of one
    distributed-optimizer instance; ``independent_all_gather`` (0.16–0.17, with cp): the
    separate all-gather twin; ``with_gtp_remat`` (0.19, default there ``True``): the full
    data-distribution group spanning the GTP axis instead of the replicate group.
    """
    if _PARTIAL_CHECK_FIRST and partial_data_parallel and not with_context_parallel:
        raise AssertionError("Partial DP for Optimizer needs to include CP (with_context_parallel=True)")
    suffix = "_WITH_GTP_REMAT" if with_gtp_remat else ""
    if with_context_parallel:
        if partial_data_parallel:
            return required(
                getattr(ps, f"_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP{suffix}"), "Intra partial data parallel group"
            )
        if independent_all_gather:
            return required(ps._DATA_PARALLEL_GROUP_WITH_CP_AG, "data parallel group with context parallel AG")
        return required(
            getattr(ps, f"_DATA_PARALLEL_GROUP_WITH_CP{suffix}"), "data parallel group with context parallel combined"
        )
    group = required(getattr(ps, f"_DATA_PARALLEL_GROUP{suffix}"), "data parallel group")
    if partial_data_parallel:
        raise AssertionError("Partial DP for Optimizer needs to include CP (with_context_parallel=True)")
    return group


def has_separate_all_gather_group() -> bool:
    """Whether a dedicated all-gather twin of the dp×cp group was created."""
    return ps._DATA_PARALLEL_GROUP_WITH_CP_AG is not None


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """The gloo twin of this rank's data-parallel group."""
    if with_context_parallel:
        if partial_data_parallel:
            return required(ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO, "Intra partial data parallel group")
        return required(ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO, "data parallel group-gloo with context parallel combined")
    group = required(ps._DATA_PARALLEL_GROUP_GLOO, "data parallel group-gloo")
    if partial_data_parallel:
        raise AssertionError("Partial DP for Optimizer needs to include CP (with_context_parallel=True)")
    return group


def get_context_parallel_group(check_initialized=True):
    """This rank's context-parallel group."""
    return checked(ps._CONTEXT_PARALLEL_GROUP, check_initialized, "context parallel group")


def get_context_parallel_global_ranks(check_initialized=True):
    """Global ranks of this rank's context-parallel group, in group order."""
    return checked(ps._CONTEXT_PARALLEL_GLOBAL_RANKS, check_initialized, "context parallel group")


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's hierarchical context-parallel groups, one per level."""
    return checked(ps._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS, check_initialized, "hierarchical context parallel group")


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """This rank's hybrid dp×cp group of ``group_size`` (the whole dp×cp group at full size)."""
    if ps.get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return checked(ps._DATA_PARALLEL_GROUP_WITH_CP, check_initialized, "data parallel group with context parallel")
    if check_initialized:
        required(ps._HYBRID_DP_CP_GROUPS, "hybrid data context parallel groups")
    return ps._HYBRID_DP_CP_GROUPS[group_size]


def get_embedding_group(check_initialized=True):
    """This rank's word-embedding group."""
    return checked(ps._EMBEDDING_GROUP, check_initialized, "embedding group")


def get_position_embedding_group(check_initialized=True):
    """This rank's position-embedding group."""
    return checked(ps._POSITION_EMBEDDING_GROUP, check_initialized, "position embedding group")


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The FP8 amax reduction group: tp×dp(×cp), or tp(×cp) with ``tp_only_amax_red``."""
    if with_context_parallel:
        group = (
            ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP if tp_only_amax_red else ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP
        )
    else:
        group = ps._TENSOR_MODEL_PARALLEL_GROUP if tp_only_amax_red else ps._TENSOR_AND_DATA_PARALLEL_GROUP
    return required(group, "FP8 amax reduction group")


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    """This rank's tp × dp (× cp with ``with_context_parallel``) group."""
    group = ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP if with_context_parallel else ps._TENSOR_AND_DATA_PARALLEL_GROUP
    return checked(group, check_initialized, "tensor and data parallel group")


def get_tensor_and_context_parallel_group(check_initialized=True):
    """This rank's tp × cp group."""
    return checked(ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP, check_initialized, "tensor and context parallel group")


# --------------------------------------------------------------------------- sizes and ranks
def set_tensor_model_parallel_world_size(world_size):
    """Override the tensor-model-parallel size that the getters report."""
    ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_pipeline_model_parallel_world_size(world_size):
    """Override the pipeline-model-parallel size that the getters report."""
    ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_virtual_pipeline_model_parallel_world_size(world_size):
    """Set the virtual-pipeline size."""
    ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank):
    """Override the tensor-model-parallel rank that the getters report."""
    ps._MPU_TENSOR_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_rank(rank):
    """Override the pipeline-model-parallel rank that the getters report."""
    ps._MPU_PIPELINE_MODEL_PARALLEL_RANK = rank


def set_data_parallel_rank(rank):
    """Override the data-parallel rank that the getters report."""
    ps._MPU_DATA_PARALLEL_RANK = rank


def get_tensor_model_parallel_world_size():
    """Size of the tensor-model-parallel group (or the override)."""
    if ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return ps.get_tensor_model_parallel_group().size()


def _several_pipelines() -> bool:
    """Whether this rank is in several pipelines (a 0.12/0.13 encoder rank): lists of groups/ranks."""
    ranks = ps._PIPELINE_GLOBAL_RANKS
    return bool(ranks) and isinstance(ranks[0], list)


def get_pipeline_model_parallel_world_size():
    """Size of the pipeline-model-parallel group (or the override).

    A rank in several pipelines (0.12/0.13 encoder) gets their common size.
    """
    if ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        return ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    group = ps.get_pipeline_model_parallel_group()
    if isinstance(group, list):
        sizes = {len(ranks) for ranks in ps._PIPELINE_GLOBAL_RANKS}
        if len(sizes) != 1:
            raise AssertionError(f"this rank's pipelines differ in size: {sorted(sizes)}")
        return group[0].size()
    return group.size()


def get_tensor_model_parallel_rank():
    """This rank's position in its tensor-model-parallel group (or the override)."""
    if ps._MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return ps._MPU_TENSOR_MODEL_PARALLEL_RANK
    return ps.get_tensor_model_parallel_group().rank()


def get_pipeline_model_parallel_rank():
    """This rank's pipeline stage (or the override)."""
    if ps._MPU_PIPELINE_MODEL_PARALLEL_RANK is not None:
        return ps._MPU_PIPELINE_MODEL_PARALLEL_RANK
    if _RANK_FIRST:
        torch.distributed.get_rank()  # 0.12/0.13 read the world rank first (ValueError without a world)
    group = ps.get_pipeline_model_parallel_group()
    if isinstance(group, list):  # a 0.12/0.13 encoder rank: the same stage in each of its pipelines
        rank = torch.distributed.get_rank()
        stages = {ranks.index(rank) for ranks in ps._PIPELINE_GLOBAL_RANKS if rank in ranks}
        if len(stages) != 1:
            raise AssertionError(f"rank {rank} is at different stages of its pipelines: {sorted(stages)}")
        group = group[0]
    return torch.distributed.get_rank(group=group)


def get_data_parallel_world_size(with_context_parallel=False, with_gtp_remat=False, partial_data_parallel=False):
    """Size of this rank's data-parallel group (0 without torch.distributed)."""
    if ps._MPU_DATA_PARALLEL_WORLD_SIZE is not None:
        return ps._MPU_DATA_PARALLEL_WORLD_SIZE
    if not distributed():
        return 0
    return ps.get_data_parallel_group(
        with_context_parallel=with_context_parallel,
        partial_data_parallel=partial_data_parallel,
        **gtp_keyword(with_gtp_remat),
    ).size()


def get_data_parallel_rank(with_context_parallel=False, with_gtp_remat=False, partial_data_parallel=False):
    """This rank's position in its data-parallel group (0 without torch.distributed)."""
    if ps._MPU_DATA_PARALLEL_RANK is not None:
        return ps._MPU_DATA_PARALLEL_RANK
    if not distributed():
        return 0
    return ps.get_data_parallel_group(
        with_context_parallel=with_context_parallel,
        partial_data_parallel=partial_data_parallel,
        **gtp_keyword(with_gtp_remat),
    ).rank()


def get_context_parallel_world_size():
    """Size of this rank's context-parallel group (0 without torch.distributed)."""
    return ps.get_context_parallel_group().size() if distributed() else 0


def get_context_parallel_rank():
    """This rank's position in its context-parallel group (0 without torch.distributed)."""
    return ps.get_context_parallel_group().rank() if distributed() else 0


def get_tensor_and_context_parallel_world_size():
    """Size of this rank's tp × cp group (0 without torch.distributed)."""
    return ps.get_tensor_and_context_parallel_group().size() if distributed() else 0


def get_tensor_and_context_parallel_rank():
    """This rank's position in its tp × cp group (0 without torch.distributed)."""
    return ps.get_tensor_and_context_parallel_group().rank() if distributed() else 0


# --------------------------------------------------------------------------- pipeline stages
def _virtual_stage_matches(ignore_virtual: bool, vp_stage: int | None, wanted: Callable[[int], int]) -> bool:
    """False when a virtual stage is in play and ``vp_stage`` is not the wanted one."""
    vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
    if ignore_virtual or vp_size is None:
        return True
    if _STAGE_FROM_GLOBAL:
        return ps.get_virtual_pipeline_model_parallel_rank() == wanted(vp_size)
    if vp_stage is None:
        raise AssertionError("vp_stage must be passed if virtual pipeline is enabled")
    return vp_stage == wanted(vp_size)


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """Whether this rank runs the first pipeline stage (and ``vp_stage`` is the first chunk)."""
    if not _virtual_stage_matches(ignore_virtual, vp_stage, lambda size: 0):
        return False
    return ps.get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """Whether this rank runs the last pipeline stage (and ``vp_stage`` is the last chunk)."""
    if not _virtual_stage_matches(ignore_virtual, vp_stage, lambda size: size - 1):
        return False
    return ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """Whether this rank holds word embeddings (with virtual stages: in this chunk)."""
    rank = torch.distributed.get_rank()
    ranks = ps._EMBEDDING_GLOBAL_RANKS
    if ranks is None or rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return ps.is_pipeline_first_stage(
            **served_keywords("is_pipeline_first_stage", ignore_virtual=False, vp_stage=vp_stage)
        )
    if rank == ranks[-1]:
        return ps.is_pipeline_last_stage(
            **served_keywords("is_pipeline_last_stage", ignore_virtual=False, vp_stage=vp_stage)
        )
    return True


def is_rank_in_position_embedding_group():
    """Whether this rank holds position embeddings."""
    rank = torch.distributed.get_rank()
    return ps._POSITION_EMBEDDING_GLOBAL_RANKS is not None and rank in ps._POSITION_EMBEDDING_GLOBAL_RANKS


def get_virtual_pipeline_model_parallel_rank():
    """The virtual pipeline rank (deprecated global state; ``None`` without interleaving)."""
    return ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank):
    """Set the virtual pipeline rank (deprecated from 0.13 on: pass ``vp_stage`` instead)."""
    if _SETTER_WARNS:
        warnings.warn(
            "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
            "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
            DeprecationWarning,
            stacklevel=1,
        )
    ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size():
    """The number of virtual pipeline chunks per rank (``None`` without interleaving)."""
    return ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def get_tensor_model_parallel_src_rank():
    """Global rank of the first member of this rank's tensor-model-parallel group."""
    return required(ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS, "Tensor model parallel group")[0]


def get_model_parallel_src_rank():
    """Global rank of the first member of this rank's model-parallel group."""
    return required(ps._MODEL_PARALLEL_GLOBAL_RANKS, "Model parallel group")[0]


def get_data_parallel_src_rank(with_context_parallel=False):
    """Global rank of the first member of this rank's data-parallel (× cp) group."""
    if with_context_parallel:
        return required(ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP, "Data parallel group with context parallel combined")[0]
    return required(ps._DATA_PARALLEL_GLOBAL_RANKS, "Data parallel group")[0]


def _stage_ranks(position: Callable[[], int]) -> Any:
    """The global rank at stage ``position()`` of this rank's pipeline; a list of them, one per
    pipeline, for a rank in several (0.12/0.13 encoder).
    """
    ranks = required(ps._PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    i = position()
    return [pipeline[i] for pipeline in ranks] if _several_pipelines() else ranks[i]


def get_pipeline_model_parallel_first_rank():
    """Global rank of the first stage of this rank's pipeline (all its pipelines share it)."""
    ranks = required(ps._PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    if _several_pipelines():
        if len({pipeline[0] for pipeline in ranks}) != 1:
            raise AssertionError(f"this rank's pipelines start at different ranks: {ranks}")
        return ranks[0][0]
    return ranks[0]


def get_pipeline_model_parallel_last_rank():
    """Global rank of the last stage of this rank's pipeline (one per pipeline for a rank in several)."""
    required(ps._PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    return _stage_ranks(lambda: ps.get_pipeline_model_parallel_world_size() - 1)


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage of this rank's pipeline (wrapping around)."""
    required(ps._PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    return _stage_ranks(
        lambda: (ps.get_pipeline_model_parallel_rank() + 1) % ps.get_pipeline_model_parallel_world_size()
    )


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage of this rank's pipeline (wrapping around)."""
    required(ps._PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    return _stage_ranks(
        lambda: (ps.get_pipeline_model_parallel_rank() - 1) % ps.get_pipeline_model_parallel_world_size()
    )
