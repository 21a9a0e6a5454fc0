"""Expert-layer, GTP weight-rematerialization (0.19), distributed-optimizer and buffer
accessors of ``compat.parallel_state`` — one implementation each (see ``compat._getters``).
"""

from __future__ import annotations

import warnings

from ._buffers import GlobalMemoryBuffer
from ._getters import (
    checked,
    distributed,
    gtp_keyword,
    required,
    served_keywords,
)
from ._namespace import facade as ps
from ._release import FACTS

__all__: list[str] = []  # served through compat.parallel_state


# --------------------------------------------------------------------------- expert parallel
def get_expert_model_parallel_group(check_initialized=True):
    """This rank's expert-model-parallel group."""
    return checked(ps._EXPERT_MODEL_PARALLEL_GROUP, check_initialized, "expert model parallel group")


def get_expert_model_parallel_src_rank():
    """Global rank of the first member of this rank's expert-model-parallel group."""
    return required(ps._EXPERT_MODEL_PARALLEL_RANKS, "Expert model parallel group")[0]


def get_expert_model_parallel_world_size():
    """Size of this rank's expert-model-parallel group (or the override; 0 without dist)."""
    if ps._MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE is not None:
        return ps._MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    return ps.get_expert_model_parallel_group().size() if distributed() else 0


def set_expert_model_parallel_world_size(world_size):
    """Override the expert-model-parallel size that the getters report."""
    ps._MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = world_size


def get_expert_model_parallel_rank():
    """This rank's position in its expert-model-parallel group (or the override)."""
    if ps._MPU_EXPERT_MODEL_PARALLEL_RANK is not None:
        return ps._MPU_EXPERT_MODEL_PARALLEL_RANK
    return ps.get_expert_model_parallel_group().rank() if distributed() else 0


def set_expert_model_parallel_rank(rank):
    """Override the expert-model-parallel rank that the getters report."""
    ps._MPU_EXPERT_MODEL_PARALLEL_RANK = rank


def get_expert_tensor_parallel_group(check_initialized=True):
    """This rank's expert-tensor-parallel group."""
    return checked(ps._EXPERT_TENSOR_PARALLEL_GROUP, check_initialized, "Expert tensor parallel group")


def get_expert_tensor_parallel_world_size():
    """Size of the expert-tensor-parallel group (falls back to the tp override before init)."""
    if ps._MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE is not None:
        return ps._MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE
    if not ps._EXPERT_TENSOR_PARALLEL_GROUP:
        return ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return ps.get_expert_tensor_parallel_group().size()


def set_expert_tensor_parallel_world_size(world_size):
    """Override the expert-tensor-parallel size that the getters report."""
    ps._MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE = world_size


def get_expert_tensor_parallel_rank():
    """This rank's expert-tensor-parallel rank (falls back to the tp override before init)."""
    if ps._MPU_EXPERT_TENSOR_PARALLEL_RANK is not None:
        return ps._MPU_EXPERT_TENSOR_PARALLEL_RANK
    if not ps._EXPERT_TENSOR_PARALLEL_GROUP:
        return ps._MPU_TENSOR_MODEL_PARALLEL_RANK
    return ps.get_expert_tensor_parallel_group().rank()


def set_expert_tensor_parallel_rank(rank):
    """Override the expert-tensor-parallel rank that the getters report."""
    ps._MPU_EXPERT_TENSOR_PARALLEL_RANK = rank


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    """This rank's expert tp × ep group."""
    return checked(
        ps._EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, check_initialized, "Expert tensor and model parallel group"
    )


def get_expert_tensor_and_model_parallel_world_size():
    """Size of this rank's expert tp × ep group (0 without torch.distributed)."""
    return ps.get_expert_tensor_and_model_parallel_group().size() if distributed() else 0


def get_expert_tensor_and_model_parallel_rank():
    """This rank's position in its expert tp × ep group (0 without torch.distributed)."""
    return ps.get_expert_tensor_and_model_parallel_group().rank() if distributed() else 0


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True, with_egtp_remat=False):
    """This rank's expert tp × ep × pp group (0.19 ``with_egtp_remat``: also across expert GTP peers)."""
    if with_egtp_remat:
        return checked(
            ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP,
            check_initialized,
            "Expert tensor-model-pipeline parallel group with EGTP",
        )
    return checked(
        ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP,
        check_initialized,
        "Expert tensor-model-pipeline parallel group",
    )


def get_expert_data_parallel_group(check_initialized=True, with_gtp_remat=False, partial_expert_data_parallel=False):
    """This rank's expert-data-parallel group (or its share within one optimizer instance).

    ``with_gtp_remat`` (0.19, default there ``True``): the group spanning the expert GTP axis.
    """
    suffix = "_WITH_GTP_REMAT" if with_gtp_remat else ""
    if partial_expert_data_parallel:
        return checked(
            getattr(ps, f"_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP{suffix}"),
            check_initialized,
            "Intra partial expert data parallel group",
        )
    return checked(getattr(ps, f"_EXPERT_DATA_PARALLEL_GROUP{suffix}"), check_initialized, "Expert data parallel group")


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    """Deprecated name of ``get_expert_data_parallel_group``."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group instead.",
        DeprecationWarning,
        stacklevel=1,
    )
    return ps.get_expert_data_parallel_group(
        **served_keywords("get_expert_data_parallel_group", partial_expert_data_parallel=partial_expert_data_parallel)
    )


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    """The gloo twin of this rank's expert-data-parallel group."""
    if partial_expert_data_parallel:
        return required(
            ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO, "Intra partial expert data parallel group-gloo"
        )
    return required(ps._EXPERT_DATA_PARALLEL_GROUP_GLOO, "Expert data parallel group-gloo")


def get_expert_data_parallel_rank(with_gtp_remat=False, partial_expert_data_parallel=False):
    """This rank's position in its expert-data-parallel group (0 without torch.distributed)."""
    if not distributed():
        return 0
    return ps.get_expert_data_parallel_group(
        **served_keywords("get_expert_data_parallel_group", partial_expert_data_parallel=partial_expert_data_parallel),
        **gtp_keyword(with_gtp_remat),
    ).rank()


def get_expert_data_parallel_world_size(with_gtp_remat=False, partial_expert_data_parallel=False):
    """Size of this rank's expert-data-parallel group (0 without torch.distributed)."""
    if not distributed():
        return 0
    return ps.get_expert_data_parallel_group(
        **served_keywords("get_expert_data_parallel_group", partial_expert_data_parallel=partial_expert_data_parallel),
        **gtp_keyword(with_gtp_remat),
    ).size()


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """All ranks of this rank's distributed-optimizer instance."""
    return checked(
        ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP, check_initialized, "Intra distributed optimizer instance group"
    )


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """The group across distributed-optimizer instances (shared by dense and expert layers)."""
    return checked(
        ps._INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP, check_initialized, "Inter distributed optimizer instance group"
    )


# --------------------------------------------------------------------------- GTP (0.19)
def get_gtp_weight_remat_group(check_initialized=True):
    """This rank's GTP weight-rematerialization group (a singleton with GTP size 1)."""
    return checked(ps._GTP_WEIGHT_REMAT_GROUP, check_initialized, "generalized tensor parallel group")


def get_gtp_weight_remat_world_size():
    """Size of this rank's GTP group (0 without torch.distributed or before init)."""
    group = ps.get_gtp_weight_remat_group(check_initialized=False) if distributed() else None
    return 0 if group is None else group.size()


def get_gtp_weight_remat_rank():
    """This rank's position in its GTP group (0 without torch.distributed or before init)."""
    group = ps.get_gtp_weight_remat_group(check_initialized=False) if distributed() else None
    return 0 if group is None else group.rank()


def get_gtp_weight_remat_global_ranks(check_initialized=True):
    """Global ranks of this rank's GTP group."""
    return checked(ps._GTP_WEIGHT_REMAT_GLOBAL_RANKS, check_initialized, "generalized tensor parallel group")


def get_expert_gtp_weight_remat_group(check_initialized=True):
    """This rank's expert GTP weight-rematerialization group (a singleton with size 1)."""
    return checked(ps._EXPERT_GTP_WEIGHT_REMAT_GROUP, check_initialized, "expert generalized tensor parallel group")


def get_expert_gtp_weight_remat_world_size():
    """Size of this rank's expert GTP group (0 without torch.distributed or before init)."""
    group = ps.get_expert_gtp_weight_remat_group(check_initialized=False) if distributed() else None
    return 0 if group is None else group.size()


def get_expert_gtp_weight_remat_rank():
    """This rank's position in its expert GTP group (0 without torch.distributed or before init)."""
    group = ps.get_expert_gtp_weight_remat_group(check_initialized=False) if distributed() else None
    return 0 if group is None else group.rank()


def get_expert_gtp_weight_remat_global_ranks(check_initialized=True):
    """Global ranks of this rank's expert GTP group."""
    return checked(
        ps._EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS, check_initialized, "expert generalized tensor parallel group"
    )


# --------------------------------------------------------------------------- buffers
def set_global_memory_buffer() -> None:
    """Create the global memory buffer (once)."""
    if ps._GLOBAL_MEMORY_BUFFER is not None:
        raise AssertionError("global memory buffer is already initialized")
    ps._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def set_global_symmetric_memory_buffer() -> None:
    """Create the global symmetric memory buffer over the tensor-parallel group (0.16; needs
    megatron-core and a GPU build of torch with symmetric memory).
    """
    if ps._GLOBAL_SYMMETRIC_MEMORY_BUFFER is not None:
        raise AssertionError("global symmetric memory buffer is already initialized")
    from megatron.core.utils import GlobalSymmetricMemoryBuffer

    ps._GLOBAL_SYMMETRIC_MEMORY_BUFFER = GlobalSymmetricMemoryBuffer(
        size_in_mb=256, process_group=ps.get_tensor_model_parallel_group()
    )


def get_global_memory_buffer():
    """The global memory buffer."""
    return required(ps._GLOBAL_MEMORY_BUFFER, "global memory buffer")


def get_global_symmetric_memory_buffer():
    """The global symmetric memory buffer."""
    return required(ps._GLOBAL_SYMMETRIC_MEMORY_BUFFER, "global symmetric memory buffer")


def destroy_global_memory_buffer():
    """Drop the global memory buffer."""
    ps._GLOBAL_MEMORY_BUFFER = None


def destroy_global_symmetric_memory_buffer():
    """Drop the global symmetric memory buffer."""
    ps._GLOBAL_SYMMETRIC_MEMORY_BUFFER = None


#: The getter of this rank's position in a group of each kind ``get_all_ranks`` reports
#: (0.19's default data-parallel rank spans the GTP axis).
_RANK_GETTERS = {
    "tp": "get_tensor_model_parallel_rank",
    "gtp_remat": "get_gtp_weight_remat_rank",
    "dp": "get_data_parallel_rank",
    "gtp_remat_dp": "get_data_parallel_rank",
    "cp": "get_context_parallel_rank",
    "pp": "get_pipeline_model_parallel_rank",
    "ep": "get_expert_model_parallel_rank",
}


def get_all_ranks():
    """This rank's tp, (0.19: gtp_remat,) dp, cp, pp and ep ranks joined by ``_`` (``'1_0_0_2_0'``)."""
    ranks = [getattr(ps, _RANK_GETTERS[kind])() for kind in FACTS.all_ranks_kinds]
    return "_".join(str(r or 0) for r in ranks)
