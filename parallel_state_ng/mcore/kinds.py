"""The group kinds of Megatron-Core's ``parallel_state`` and how it reads ``order``.

:data:`GROUP_KINDS` names every kind of process group some supported release (0.14 … 0.19)
builds, with the ``group_desc`` MCore gives it, the rank-generator token it is enumerated
from, the release that introduced it and when it is created. Kind names are MCore's NCCL
communicator-config keys (the ``nccl_comm_cfgs`` section that configures the group) where one
exists. :class:`~parallel_state_ng.mcore.layout.MegatronLayout` computes every kind.

Kinds, with the MCore global (``group_desc`` where it differs) and the rank generator
("view") and ``get_ranks`` token they come from:

- ``gtp_remat``: ``_GTP_WEIGHT_REMAT_GROUP`` (0.19); dense ``gtp_remat`` (``get_gtp_ranks``).
- ``dp_cp``: ``_DATA_PARALLEL_GROUP_WITH_CP``; dense ``dp-cp``.
- ``dp_cp_ag``: ``_DATA_PARALLEL_GROUP_WITH_CP_AG``; 0.16-0.17 (``create_all_gather_group=True``):
  the ranks of ``dp_cp``; 0.18+ (``create_all_gather_groups()``): ``dp-cp`` of that function's
  own generator (default order, offset 0).
- ``intra_dp_cp``: ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``; chunks of each dp-cp group.
- ``dp``: ``_DATA_PARALLEL_GROUP``; dense ``dp``.
- ``gtp_remat_dp``: ``_DATA_PARALLEL_GROUP_WITH_GTP_REMAT`` (0.19, built when gtp > 1);
  dense ``gtp_remat-dp``.
- ``gtp_remat_dp_cp``: ``_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT`` (0.19, gtp > 1);
  dense ``gtp_remat-dp-cp``.
- ``cp``: ``_CONTEXT_PARALLEL_GROUP``; dense ``cp``.
- ``hcp<i>``: ``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS[i]``
  (``HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L<i>``); levels of each cp group.
- ``mp``: ``_MODEL_PARALLEL_GROUP``; dense ``tp-pp`` (``tp-gtp_remat-pp`` on 0.19).
- ``tp``: ``_TENSOR_MODEL_PARALLEL_GROUP``; dense ``tp``.
- ``pp``: ``_PIPELINE_MODEL_PARALLEL_GROUP``; dense ``pp``.
- ``embd`` / ``pos_embd``: ``_EMBEDDING_GROUP`` / ``_POSITION_EMBEDDING_GROUP``; the
  embedding callables applied to each pp group.
- ``tp_dp_cp``: ``_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP``; dense ``tp-dp-cp``
  (``tp-gtp_remat-dp-cp`` on 0.19).
- ``tp_dp``: ``_TENSOR_AND_DATA_PARALLEL_GROUP``; dense ``tp-dp`` (``tp-gtp_remat-dp`` on 0.19).
- ``tp_cp``: ``_TENSOR_AND_CONTEXT_PARALLEL_GROUP``; dense ``tp-cp``.
- ``expt_gtp_remat``: ``_EXPERT_GTP_WEIGHT_REMAT_GROUP`` (0.19); expert ``gtp_remat``.
- ``ep``: ``_EXPERT_MODEL_PARALLEL_GROUP``; expert ``ep``.
- ``ep_tp``: ``_EXPERT_TENSOR_PARALLEL_GROUP``; expert ``tp``.
- ``tp_ep_mp``: ``_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP``; expert ``tp-ep``.
- ``tp_ep_pp``: ``_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP``; expert ``tp-ep-pp``.
- ``tp_ep_gtp_remat_pp``: ``_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP`` (0.19);
  expert ``tp-ep-gtp_remat-pp``.
- ``ep_dp``: ``_EXPERT_DATA_PARALLEL_GROUP``; expert ``dp``.
- ``ep_dp_ag``: ``EXPERT_DATA_PARALLEL_GROUP_AG`` (0.18+, ``create_all_gather_groups(
  for_expert_parallelism=True)`` with ep > 1); ``dp`` of that function's expert generator.
- ``intra_ep_dp`` / ``inter_ep_dp``: ``_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP`` /
  ``_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP`` (``HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0/L1``);
  levels of each expert dp group.
- ``ep_gtp_remat_dp``: ``_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT`` (0.19, egtp > 1);
  expert ``gtp_remat-dp``.
- ``intra_dist_opt_instance``: ``_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP``; runs of
  consecutive expert ``tp-ep-pp`` groups (0.19 with a GTP size > 1: every rank of the layout).

Aliases MCore sets instead of building a group are not kinds: with ``gtp_remat_size == 1``
the GTP data-parallel globals are the plain data-parallel groups, and the intra-partial
"with GTP" globals are the full GTP groups (0.19 allows one optimizer instance with GTP).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "GroupKind",
    "GROUP_KINDS",
    "ORDER_TOKENS",
    "GTP_TOKEN",
    "DEFAULT_ORDER",
    "normalize_order",
    "inject_gtp_remat",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "EmptyGroupError",
    "quotient",
    "hierarchical_group",
    "token_kind_dims",
    "read_order",
]

# Tokens of MCore's ``order`` string, in the order its RankGenerator checks them.
ORDER_TOKENS = ("tp", "pp", "dp", "ep", "cp")
# The GTP weight-rematerialization axis of 0.19 (checked after the five above).
GTP_TOKEN = "gtp_remat"
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def default_embedding_ranks(pp_ranks: Sequence[int], split_rank: Optional[int] = None) -> list[int]:
    """Ranks holding the word embeddings: first and last pipeline stage (one if pp == 1).

    ``split_rank`` (0.12–0.13, deprecated there): the stage ``pp_ranks[split_rank]`` (the
    decoder's first) holds them too when it is neither the first nor the last.
    """
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    if split_rank is not None and pp_ranks[split_rank] not in (pp_ranks[0], pp_ranks[-1]):
        return [pp_ranks[0], pp_ranks[split_rank], pp_ranks[-1]]
    return [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int], split_rank: Optional[int] = None) -> list[int]:
    """Ranks holding the position embeddings: the first pipeline stage.

    ``split_rank`` (0.12–0.13): the stage ``pp_ranks[split_rank]`` too, when it is not the first.
    """
    if split_rank is not None and pp_ranks[0] != pp_ranks[split_rank]:
        return [pp_ranks[0], pp_ranks[split_rank]]
    return [pp_ranks[0]]


def inject_gtp_remat(order: str, after: str) -> str:
    """``order`` with the ``gtp_remat`` token inserted right after token ``after``.

    Read as 0.19 reads it: on the order as given (before lower-casing), an order already
    holding ``gtp_remat`` is kept, a missing ``after`` falls back to ``tp``, and a missing
    ``tp`` puts the new token first (fastest-varying).
    """
    tokens = order.split("-")
    if GTP_TOKEN in tokens:
        return order
    anchor = after if after in tokens else "tp"
    tokens.insert(tokens.index(anchor) + 1 if anchor in tokens else 0, GTP_TOKEN)
    return "-".join(tokens)


def normalize_order(order: str, sizes: dict[str, int], given: Optional[str] = None) -> list[str]:
    """MCore's reading of an ``order`` string for the given token sizes.

    ``sizes`` maps each token the rank generator knows (``ORDER_TOKENS``, plus ``gtp_remat``
    on 0.19) to its size. Lower-cases the order; a token of size > 1 missing from it raises
    ``RuntimeError`` (as MCore's RankGenerator does); tokens of size 1 missing from it are
    appended. Like MCore, "missing" is a substring test on the whole string. Unknown tokens
    raise ``KeyError`` like MCore; a repeated token raises ``ValueError`` (MCore silently
    builds a wrong layout from it). ``given`` is the order as the user wrote it, named in
    messages (default: ``order``).
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a str such as {DEFAULT_ORDER!r}, got {order!r}")
    text = order.lower()
    shown = order if given is None else given
    for name, size in sizes.items():
        if name not in text:
            if size != 1:
                raise RuntimeError(
                    f"order {shown!r} does not contain {name!r}, but its size is {size}; add {name!r} to order"
                )
            text = f"{text}-{name}"
    tokens = text.split("-")
    for tok in tokens:
        if tok not in sizes:
            raise KeyError(f"order {shown!r} has unknown token {tok!r}; known tokens are {list(sizes)}")
    dup = sorted({t for t in tokens if tokens.count(t) > 1})
    if dup:
        raise ValueError(f"order {shown!r} repeats token(s) {dup}; each token may appear once")
    return tokens


def hierarchical_group(cp_ranks: list[int], rank: int, sizes: list[int], level: int) -> Optional[list[int]]:
    """``rank``'s hierarchical context-parallel group at ``level`` within its cp group ``cp_ranks``.

    Level ``level`` groups ``sizes[level]`` ranks that are ``prod(sizes[:level])`` apart, in
    whole blocks of ``prod(sizes[:level + 1])`` consecutive positions of ``cp_ranks``. When
    ``sizes`` multiply to the cp size every rank has a group at every level; otherwise (0.12
    accepts that) ranks past the last whole block have none (``None``).
    """
    before = math.prod(sizes[:level])
    block = before * sizes[level]
    pos = cp_ranks.index(rank)
    if pos // block >= len(cp_ranks) // block:
        return None
    first = pos % before + (pos // block) * block
    return [cp_ranks[first + i * before] for i in range(sizes[level])]


class EmptyGroupError(ValueError, TypeError):
    """A user callable produced an empty group (MCore fails on it with ``TypeError``)."""


def quotient(world_size: int, what: str = "world_size", **factors: int) -> int:
    """``world_size`` divided by the product of ``factors``; ``RuntimeError`` (as MCore) if it
    does not divide, naming every factor."""
    product = math.prod(factors.values())
    if world_size % product != 0:
        named = " x ".join(f"{name} ({value})" for name, value in factors.items())
        raise RuntimeError(f"{what} ({world_size}) is not divisible by {named} = {product}")
    return world_size // product


@dataclass(frozen=True)
class GroupKind:
    """One kind of process group MCore builds.

    ``name`` is MCore's NCCL config key for it (or a descriptive name), ``desc`` the
    ``group_desc`` MCore gives it, ``what`` a description. ``view`` is the rank generator it
    comes from (``"dense"``, ``"expert"``, ``"derived"`` for kinds computed from another
    kind, ``"all_gather"`` for the all-gather generators of 0.18+), ``token`` the
    ``get_ranks`` token MCore uses (``""`` when derived), ``since`` the first release series
    that builds it and ``until`` the last (``None``: still built), ``when`` the condition
    under which it is built.
    """

    name: str
    desc: str
    what: str
    view: str = "dense"
    token: str = ""
    since: str = "0.12"
    until: Optional[str] = None
    when: str = "always"


GROUP_KINDS: dict[str, GroupKind] = {
    k.name: k
    for k in [
        GroupKind("gtp_remat", "GTP_WEIGHT_REMAT_GROUP", "GTP weight-rematerialization shards", "dense", "gtp_remat", "0.19"),
        GroupKind("dp_cp", "DATA_PARALLEL_GROUP_WITH_CP", "data parallel with context parallel (dp × cp)", "dense", "dp-cp"),
        GroupKind(
            "dp_cp_ag", "DATA_PARALLEL_GROUP_WITH_CP_AG", "all-gather twin of the dp × cp group", "all_gather", "dp-cp",
            "0.16", None, "0.16-0.17: create_all_gather_group=True (ranks of dp_cp); 0.18+: create_all_gather_groups()",
        ),
        GroupKind(
            "intra_dp_cp", "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "one distributed-optimizer instance's share of dp × cp",
            "derived", "", "0.12", None, "num_distributed_optimizer_instances > 1",
        ),
        GroupKind(
            "inter_dp_cp", "INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "dp × cp across distributed-optimizer instances",
            "derived", "", "0.12", "0.12", "num_distributed_optimizer_instances > 1",
        ),
        GroupKind("dp", "DATA_PARALLEL_GROUP", "data parallel", "dense", "dp"),
        GroupKind(
            "gtp_remat_dp", "DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "data parallel spanning the GTP axis (gtp × dp)",
            "dense", "gtp_remat-dp", "0.19", None, "gtp_remat_size > 1 (else MCore aliases dp)",
        ),
        GroupKind(
            "gtp_remat_dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "gtp × dp × cp", "dense", "gtp_remat-dp-cp",
            "0.19", None, "gtp_remat_size > 1 (else MCore aliases dp_cp)",
        ),
        GroupKind("cp", "CONTEXT_PARALLEL_GROUP", "context parallel", "dense", "cp"),
        GroupKind("mp", "MODEL_PARALLEL_GROUP", "model parallel (tp × pp; tp × gtp × pp on 0.19)", "dense", "tp-gtp_remat-pp"),
        GroupKind("tp", "TENSOR_MODEL_PARALLEL_GROUP", "tensor model parallel", "dense", "tp"),
        GroupKind("pp", "PIPELINE_MODEL_PARALLEL_GROUP", "pipeline model parallel", "dense", "pp"),
        GroupKind("embd", "EMBEDDING_GROUP", "word-embedding stages of a pipeline", "derived"),
        GroupKind("pos_embd", "POSITION_EMBEDDING_GROUP", "position-embedding stages of a pipeline", "derived"),
        GroupKind("tp_dp_cp", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "tp × dp × cp (× gtp on 0.19)", "dense", "tp-gtp_remat-dp-cp"),
        GroupKind("tp_dp", "TENSOR_AND_DATA_PARALLEL_GROUP", "tp × dp (× gtp on 0.19)", "dense", "tp-gtp_remat-dp"),
        GroupKind("tp_cp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP", "tp × cp", "dense", "tp-cp"),
        GroupKind(
            "expt_gtp_remat", "EXPERT_GTP_WEIGHT_REMAT_GROUP", "expert GTP weight-rematerialization shards", "expert",
            "gtp_remat", "0.19",
        ),
        GroupKind("ep", "EXPERT_MODEL_PARALLEL_GROUP", "expert model parallel", "expert", "ep"),
        GroupKind("ep_tp", "EXPERT_TENSOR_PARALLEL_GROUP", "expert tensor parallel", "expert", "tp"),
        GroupKind("tp_ep_mp", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "expert tp × ep", "expert", "tp-ep"),
        GroupKind("tp_ep_pp", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "expert tp × ep × pp", "expert", "tp-ep-pp"),
        GroupKind(
            "tp_ep_gtp_remat_pp", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", "expert tp × ep × egtp × pp",
            "expert", "tp-ep-gtp_remat-pp", "0.19",
        ),
        GroupKind("ep_dp", "EXPERT_DATA_PARALLEL_GROUP", "expert data parallel", "expert", "dp"),
        GroupKind(
            "ep_dp_ag", "EXPERT_DATA_PARALLEL_GROUP_AG", "all-gather twin of the expert dp group", "all_gather", "dp",
            "0.18", None, "create_all_gather_groups(for_expert_parallelism=True) with expert_model_parallel_size > 1",
        ),
        GroupKind(
            "intra_ep_dp", "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0", "one distributed-optimizer instance's share of expert dp",
            "derived", "", "0.13", None, "num_distributed_optimizer_instances > 1",
        ),
        GroupKind(
            "inter_ep_dp", "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1", "expert dp across distributed-optimizer instances",
            "derived", "", "0.13", None, "num_distributed_optimizer_instances > 1",
        ),
        GroupKind(
            "ep_gtp_remat_dp", "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "expert data parallel spanning the expert GTP axis",
            "expert", "gtp_remat-dp", "0.19", None, "expert_gtp_remat_size > 1 (else MCore aliases ep_dp)",
        ),
        GroupKind(
            "intra_dist_opt_instance", "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
            "all ranks of one distributed-optimizer instance (0.19 with a GTP size > 1: the whole layout)", "derived",
            "", "0.13",
        ),
    ]
}


@functools.lru_cache(maxsize=None)
def token_kind_dims(gtp_axis: bool) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Kind -> (view, dims) for the kinds read off a rank-generator token.

    Without the GTP axis (before 0.19) the GTP kinds are absent and ``gtp_remat`` is dropped
    from the tokens of the kinds that span it on 0.19.
    """
    out = {}
    for name, kind in GROUP_KINDS.items():
        if kind.view not in ("dense", "expert"):
            continue
        tokens = kind.token.split("-")
        if GTP_TOKEN in tokens and not gtp_axis:
            if kind.since == "0.19":
                continue
            tokens = [t for t in tokens if t != GTP_TOKEN]
        out[name] = (kind.view, tuple(tokens))
    return out


def read_order(order: str, sizes: dict[str, int], gtp_after: Optional[str]) -> list[str]:
    """The tokens of ``order`` as one of MCore's rank generators reads them.

    ``gtp_after`` is the token the 0.19 GTP axis is injected after (``None`` before 0.19).
    0.19 tests token presence by substring, so an order without ``tp`` passes the check
    through ``gtp_remat`` and then lacks ``tp``: MCore fails later (``AssertionError`` from
    its rank arithmetic when a tensor size > 1 is lost, ``ValueError`` looking ``tp`` up
    otherwise); this raises the same types up front.
    """
    if gtp_after is None:
        return normalize_order(order, sizes)
    if not isinstance(order, str):
        raise TypeError(f"order must be a str such as {DEFAULT_ORDER!r}, got {order!r}")
    injected = inject_gtp_remat(order, gtp_after)
    lowered = injected.lower().split("-")
    if lowered.count(GTP_TOKEN) > 1 and sizes.get(GTP_TOKEN, 1) == 1:
        # 0.19 injects case-sensitively: an order naming GTP_REMAT in upper case gets a second
        # gtp_remat token. At size 1 both are no-ops and MCore's layout is the one without the
        # copy (at size > 1 MCore builds ranks outside the world: normalize_order refuses).
        first = lowered.index(GTP_TOKEN)
        parts = injected.split("-")
        injected = "-".join(p for i, p in enumerate(parts) if i == first or lowered[i] != GTP_TOKEN)
    tokens = normalize_order(injected, sizes, given=order)
    if "tp" not in tokens:
        message = (
            f"order {order!r} has no 'tp' token: megatron-core 0.19 mistakes the 'tp' in "
            f"'gtp_remat' for it and cannot build the tensor-parallel groups; add 'tp' to order"
        )
        raise AssertionError(message) if sizes["tp"] != 1 else ValueError(message)
    return tokens
