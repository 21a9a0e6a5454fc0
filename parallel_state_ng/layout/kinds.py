"""Megatron-Core's process-group kinds: every fact about each kind, stated once.

:data:`GROUP_KINDS` has one :class:`GroupKind` per kind some supported release builds: its
ranks, ``group_desc``, module globals, ``ProcessGroupCollection`` field, NCCL-config key,
timeout rule and releases. The creation order, the layout math, compat and the tools all read
it. MCore's aliases (the 0.19 GTP data-parallel globals when ``gtp_remat_size == 1``, ...) are a
kind's fallbacks, not kinds. Pure data. See docs/architecture.md ("the group plan").
"""

from __future__ import annotations

import functools

from parallel_state_ng.layout.group_kind import Fill, FillValue, GroupKind  # noqa: F401 (FillValue re-exported)
from parallel_state_ng.layout.order import GTP_TOKEN
from parallel_state_ng.releases.facts import ReleaseFacts

__all__ = ["Fill", "GroupKind", "GROUP_KINDS", "ALL_GATHER_KINDS", "token_kind_dims", "kind_exists", "fills"]


def _kind(name: str, desc: str, what: str, *dims: str, **rest: object) -> GroupKind:
    rest.setdefault("nccl_key", name)
    return GroupKind(name, desc, what, dims=tuple(dims), **rest)  # type: ignore[arg-type]


_GTP = ("gtp_remat_axis",)
_PARTIAL = "num_distributed_optimizer_instances > 1"

GROUP_KINDS: dict[str, GroupKind] = {
    k.name: k
    for k in [
        _kind(
            "gtp_remat",
            "GTP_WEIGHT_REMAT_GROUP",
            "GTP weight-rematerialization shards",
            GTP_TOKEN,
            fills=(
                Fill("_GTP_WEIGHT_REMAT_GROUP", collection="gtp_remat"),
                Fill("_GTP_WEIGHT_REMAT_GLOBAL_RANKS", "ranks"),
            ),
            exists=_GTP,
        ),
        _kind(
            "dp_cp",
            "DATA_PARALLEL_GROUP_WITH_CP",
            "data parallel with context parallel (dp × cp)",
            "dp",
            "cp",
            fills=(
                Fill("_DATA_PARALLEL_GROUP_WITH_CP", collection="dp_cp"),
                Fill("_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "ranks"),
                Fill("_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "gloo"),
            ),
            gloo_desc="DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        ),
        _kind(
            "dp_cp_ag",
            "DATA_PARALLEL_GROUP_WITH_CP_AG",
            "all-gather twin of the dp × cp group",
            "dp",
            "cp",
            view="all_gather",
            fills=(Fill("_DATA_PARALLEL_GROUP_WITH_CP_AG"),),
            nccl_key="dp_cp",
            exists=("all_gather_group_in_init", "all_gather_groups_function"),
            when="0.16-0.17: create_all_gather_group=True (the ranks of dp_cp); 0.18+: create_all_gather_groups()",
        ),
        _kind(
            "intra_dp_cp",
            "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
            "one distributed-optimizer instance's share of dp × cp",
            view="derived",
            when=_PARTIAL,
            gloo_desc="INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
            fills=(
                Fill(
                    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                    fallback="_DATA_PARALLEL_GROUP_WITH_CP",
                    collection="intra_dp_cp",
                ),
                Fill(
                    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                    "gloo",
                    fallback="_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                ),
            ),
        ),
        _kind(
            "inter_dp_cp",
            "INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
            "dp × cp across distributed-optimizer instances",
            view="derived",
            when=_PARTIAL,
            exists=("inter_partial_dp",),
            fills=(Fill("_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"),),
        ),
        _kind(
            "dp",
            "DATA_PARALLEL_GROUP",
            "data parallel",
            "dp",
            gloo_desc="DATA_PARALLEL_GROUP_GLOO",
            fills=(
                Fill("_DATA_PARALLEL_GROUP", collection="dp"),
                Fill("_DATA_PARALLEL_GLOBAL_RANKS", "ranks"),
                Fill("_DATA_PARALLEL_GROUP_GLOO", "gloo"),
            ),
        ),
        _kind(
            "gtp_remat_dp",
            "DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
            "data parallel spanning the GTP axis (gtp × dp)",
            GTP_TOKEN,
            "dp",
            exists=_GTP,
            when="gtp_remat_size > 1",
            fills=(Fill("_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", fallback="_DATA_PARALLEL_GROUP"),),
        ),
        _kind(
            "gtp_remat_dp_cp",
            "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
            "gtp × dp × cp",
            GTP_TOKEN,
            "dp",
            "cp",
            exists=_GTP,
            when="gtp_remat_size > 1",
            fills=(
                Fill(
                    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
                    fallback="_DATA_PARALLEL_GROUP_WITH_CP",
                    collection="dp_cp_gtp_remat",
                ),
                Fill(
                    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
                    fallback="_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                ),
            ),
        ),
        _kind(
            "cp",
            "CONTEXT_PARALLEL_GROUP",
            "context parallel",
            "cp",
            fills=(Fill("_CONTEXT_PARALLEL_GROUP", collection="cp"), Fill("_CONTEXT_PARALLEL_GLOBAL_RANKS", "ranks")),
        ),
        _kind(
            "hcp",
            "HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{level}",
            "one level of hierarchical context parallelism",
            view="derived",
            when="hierarchical_context_parallel_sizes",
            timeout_flipped_by="hierarchical_cp_default_timeout",
            fills=(Fill("_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", "levels", collection="hcp"),),
        ),
        _kind(
            "hybrid_dp_cp",
            "HYBRID_DP_CP_GROUP_{size}",
            "a power-of-two chunk of the dp × cp group",
            view="derived",
            exists=("hybrid_context_parallel",),
            when="hybrid_context_parallel=True",
            nccl_key="dp_cp",
            timeout="torch",
            fills=(Fill("_HYBRID_DP_CP_GROUPS", "by_size"),),
        ),
        _kind(
            "mp",
            "MODEL_PARALLEL_GROUP",
            "model parallel (tp × pp; tp × gtp × pp on 0.19)",
            "tp",
            GTP_TOKEN,
            "pp",
            fills=(Fill("_MODEL_PARALLEL_GROUP", collection="mp"), Fill("_MODEL_PARALLEL_GLOBAL_RANKS", "ranks")),
        ),
        _kind(
            "tp",
            "TENSOR_MODEL_PARALLEL_GROUP",
            "tensor model parallel",
            "tp",
            fills=(
                Fill("_TENSOR_MODEL_PARALLEL_GROUP", collection="tp"),
                Fill("_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "ranks"),
            ),
        ),
        _kind(
            "pp",
            "PIPELINE_MODEL_PARALLEL_GROUP",
            "pipeline model parallel",
            "pp",
            several="list",
            fills=(Fill("_PIPELINE_MODEL_PARALLEL_GROUP", collection="pp"), Fill("_PIPELINE_GLOBAL_RANKS", "ranks")),
        ),
        _kind(
            "embd",
            "EMBEDDING_GROUP",
            "word-embedding stages of a pipeline",
            view="derived",
            when="the rank holds word embeddings",
            fills=(Fill("_EMBEDDING_GROUP", collection="embd"), Fill("_EMBEDDING_GLOBAL_RANKS", "ranks")),
        ),
        _kind(
            "pos_embd",
            "POSITION_EMBEDDING_GROUP",
            "position-embedding stages of a pipeline",
            view="derived",
            when="the rank holds position embeddings",
            fills=(
                Fill("_POSITION_EMBEDDING_GROUP", collection="pos_embd"),
                Fill("_POSITION_EMBEDDING_GLOBAL_RANKS", "ranks"),
            ),
        ),
        _kind(
            "tp_dp_cp",
            "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
            "tp × dp × cp (× gtp on 0.19)",
            "tp",
            GTP_TOKEN,
            "dp",
            "cp",
            fills=(Fill("_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", collection="tp_dp_cp"),),
        ),
        _kind(
            "tp_dp",
            "TENSOR_AND_DATA_PARALLEL_GROUP",
            "tp × dp (× gtp on 0.19)",
            "tp",
            GTP_TOKEN,
            "dp",
            fills=(Fill("_TENSOR_AND_DATA_PARALLEL_GROUP"),),
        ),
        _kind(
            "tp_cp",
            "TENSOR_AND_CONTEXT_PARALLEL_GROUP",
            "tp × cp",
            "tp",
            "cp",
            fills=(Fill("_TENSOR_AND_CONTEXT_PARALLEL_GROUP", collection="tp_cp"),),
        ),
        _kind(
            "expt_gtp_remat",
            "EXPERT_GTP_WEIGHT_REMAT_GROUP",
            "expert GTP weight-rematerialization shards",
            GTP_TOKEN,
            view="expert",
            exists=_GTP,
            fills=(
                Fill("_EXPERT_GTP_WEIGHT_REMAT_GROUP", collection="expt_gtp_remat"),
                Fill("_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS", "ranks"),
            ),
        ),
        _kind(
            "ep",
            "EXPERT_MODEL_PARALLEL_GROUP",
            "expert model parallel",
            "ep",
            view="expert",
            timeout="torch",
            timeout_flipped_by="expert_group_timeout",
            fills=(
                Fill("_EXPERT_MODEL_PARALLEL_GROUP", collection="ep"),
                Fill("_EXPERT_MODEL_PARALLEL_RANKS", "ranks"),
            ),
        ),
        _kind(
            "ep_tp",
            "EXPERT_TENSOR_PARALLEL_GROUP",
            "expert tensor parallel",
            "tp",
            view="expert",
            fills=(Fill("_EXPERT_TENSOR_PARALLEL_GROUP", collection="expt_tp"),),
        ),
        _kind(
            "tp_ep_mp",
            "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
            "expert tp × ep",
            "tp",
            "ep",
            view="expert",
            fills=(Fill("_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", collection="tp_ep"),),
        ),
        _kind(
            "tp_ep_pp",
            "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
            "expert tp × ep × pp",
            "tp",
            "ep",
            "pp",
            view="expert",
            fills=(Fill("_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", collection="tp_ep_pp"),),
        ),
        _kind(
            "tp_ep_gtp_remat_pp",
            "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
            "expert tp × ep × egtp × pp",
            "tp",
            "ep",
            GTP_TOKEN,
            "pp",
            view="expert",
            exists=_GTP,
            fills=(
                Fill("_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", collection="tp_ep_pp_with_egtp_remat"),
            ),
        ),
        _kind(
            "ep_dp",
            "EXPERT_DATA_PARALLEL_GROUP",
            "expert data parallel",
            "dp",
            view="expert",
            gloo_desc="EXPERT_DATA_PARALLEL_GROUP_GLOO",
            gloo_timeout="torch",
            fills=(
                Fill("_EXPERT_DATA_PARALLEL_GROUP", collection="expt_dp"),
                Fill("_EXPERT_DATA_PARALLEL_GROUP_GLOO", "gloo"),
            ),
        ),
        _kind(
            "ep_dp_ag",
            "EXPERT_DATA_PARALLEL_GROUP_AG",
            "all-gather twin of the expert dp group",
            "dp",
            view="all_gather",
            nccl_key="ep_dp",
            exists=("all_gather_groups_function",),
            when="create_all_gather_groups(for_expert_parallelism=True) with expert_model_parallel_size > 1",
        ),
        _kind(
            "intra_ep_dp",
            "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0",
            "one distributed-optimizer instance's share of expert dp",
            view="derived",
            exists=("partial_expert_dp",),
            when=_PARTIAL,
            gloo_nccl_options=True,
            gloo_desc="HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L0",
            fills=(
                Fill(
                    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
                    fallback="_EXPERT_DATA_PARALLEL_GROUP",
                    collection="intra_expt_dp",
                ),
                Fill(
                    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
                    "gloo",
                    fallback="_EXPERT_DATA_PARALLEL_GROUP_GLOO",
                ),
            ),
        ),
        _kind(
            "inter_ep_dp",
            "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1",
            "expert dp across distributed-optimizer instances",
            view="derived",
            exists=("partial_expert_dp",),
            when=_PARTIAL,
            gloo_nccl_options=True,
            gloo_desc="HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L1",
            fills=(Fill("_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", collection="inter_dist_opt"),),
        ),
        _kind(
            "ep_gtp_remat_dp",
            "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
            "expert data parallel spanning the expert GTP axis",
            GTP_TOKEN,
            "dp",
            view="expert",
            exists=_GTP,
            when="expert_gtp_remat_size > 1",
            fills=(
                Fill(
                    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
                    fallback="_EXPERT_DATA_PARALLEL_GROUP",
                    collection="expt_dp_gtp_remat",
                ),
                Fill(
                    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
                    fallback="_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
                ),
            ),
        ),
        _kind(
            "intra_dist_opt_instance",
            "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
            "all ranks of one distributed-optimizer instance (0.19 with a GTP size > 1: the whole layout)",
            view="derived",
            exists=("dist_opt_instance_group",),
            fills=(Fill("_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", collection="intra_dist_opt"),),
        ),
    ]
}

#: The kinds built on request after init (their own generators on 0.18+).
ALL_GATHER_KINDS: tuple[str, ...] = tuple(name for name, kind in GROUP_KINDS.items() if kind.view == "all_gather")


def kind_exists(kind: str, facts: ReleaseFacts) -> bool:
    """Whether the release of ``facts`` ever builds ``kind``."""
    needed = GROUP_KINDS[kind].exists
    return not needed or any(getattr(facts, fact) for fact in needed)


@functools.cache
def fills() -> tuple[tuple[GroupKind, Fill], ...]:
    """Every (kind, global) pair of the table, in table order (built once: the table is constant)."""
    return tuple((kind, fill) for kind in GROUP_KINDS.values() for fill in kind.fills)


@functools.cache
def token_kind_dims(gtp_axis: bool) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Kind -> (view, dims) for the kinds read off a rank-generator token.

    Without the GTP axis (before 0.19) the GTP kinds are absent and ``gtp_remat`` is dropped
    from the dims of the kinds that span it on 0.19.
    """
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, kind in GROUP_KINDS.items():
        if kind.view not in ("dense", "expert"):
            continue
        if GTP_TOKEN in kind.dims and not gtp_axis:
            if kind.exists == _GTP:
                continue
            out[name] = (kind.view, tuple(t for t in kind.dims if t != GTP_TOKEN))
        else:
            out[name] = (kind.view, kind.dims)
    return out
