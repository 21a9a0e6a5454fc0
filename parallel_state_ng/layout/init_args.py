"""The arguments of one ``initialize_model_parallel`` call, as one typed, frozen value.

:class:`InitArgs` holds the union of every supported release's parameters; a parameter the
served release lacks keeps its default here, which means what that release does (no hybrid
groups, no all-gather group, no offset, GTP sizes 1). compat's ``initialize_model_parallel``
builds one from its own parameters, name by name, and hands it down the build pipeline
(agree, prepare, build, publish): a reader follows ``tensor_model_parallel_size`` from the facade
to the layout as one attribute of one object. Pure data: no ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["InitArgs", "EmbeddingRanks"]

#: Megatron's embedding-rank functions: ``(pipeline ranks, split rank or None) -> ranks``.
EmbeddingRanks = Callable[[list[int], int | None], list[int]]


@dataclass(frozen=True)
class InitArgs:
    """One ``initialize_model_parallel`` call's arguments, under Megatron's parameter names.

    Values are kept as given (no conversion): validation
    (:func:`~parallel_state_ng.layout.validate.validate_initialize_args`) names the parameter and
    the value it refuses. Every field's default is the default of each release that has the
    parameter (``tests/layout/test_init_args.py`` checks that against the release table).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_model_parallel_split_rank: int | None = None
    pipeline_model_parallel_comm_backend: str | None = None
    use_sharp: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: Sequence[int] | None = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    gtp_remat_size: int = 1
    expert_gtp_remat_size: int = 1
    num_distributed_optimizer_instances: int = 1
    expert_tensor_parallel_size: int | None = None
    nccl_communicator_config_path: str | None = None
    distributed_timeout_minutes: float = 30
    order: str = "tp-cp-ep-dp-pp"
    encoder_tensor_model_parallel_size: int = 0
    encoder_pipeline_model_parallel_size: int | None = 0
    get_embedding_ranks: EmbeddingRanks | None = None
    get_position_embedding_ranks: EmbeddingRanks | None = None
    create_gloo_process_groups: bool = True
    high_priority_stream_groups: Sequence[str] | None = None
    sharp_enabled_group: str | None = None
    create_all_gather_group: bool | None = False
    rank_offset: int = 0
    local_world_size: int | None = None

    def fields(self) -> dict[str, Any]:
        """Every argument by name, values as given (the agreement check compares these)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> InitArgs:
        """A copy with ``changes`` (e.g. the SHARP group after its default is resolved)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The parameter names, in the union signature's order."""
        return tuple(field.name for field in dataclasses.fields(cls))
