"""Megatron-Core's process-group kinds as pure layout math.

:class:`MegatronLayout` describes, for one ``initialize_model_parallel`` configuration, every
group kind MCore 0.16.1 builds (tensor, pipeline, data, context, expert, ...) as groups of a
:class:`~parallel_state_ng.layout.Layout`: the dense ("decoder") layout ``tp, cp, dp, pp`` and
the expert layout ``etp, ep, edp, pp`` (same order string, pp shared), plus the derived kinds
(hierarchical context parallel, partial data parallel, embedding, distributed-optimizer
instance, hybrid dp×cp). For any rank it gives that rank's group of any kind in closed form,
with MCore's in-group order; it can also enumerate all groups of a kind (for tools and tests).

No ``torch.distributed`` here: the compat module turns these rank lists into process groups.
Kinds are named after MCore's NCCL communicator-config keys where one exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from .layout import Layout

__all__ = [
    "MegatronLayout",
    "GroupKind",
    "GROUP_KINDS",
    "ORDER_TOKENS",
    "normalize_order",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "EmptyGroupError",
]

# Tokens of MCore's ``order`` string, in the order its RankGenerator checks them.
ORDER_TOKENS = ("tp", "pp", "dp", "ep", "cp")


def default_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """Ranks holding the word embeddings: first and last pipeline stage (one if pp == 1)."""
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    return [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """Ranks holding the position embeddings: the first pipeline stage."""
    return [pp_ranks[0]]


def normalize_order(order: str, sizes: dict[str, int]) -> list[str]:
    """MCore's reading of an ``order`` string for the given token sizes.

    Lower-cases it; a token of size > 1 missing from it raises ``RuntimeError`` (as MCore's
    RankGenerator does); tokens of size 1 missing from it are appended. Unknown tokens raise
    ``KeyError`` like MCore; a repeated token raises ``ValueError`` (MCore silently builds a
    wrong layout from it).
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a str such as 'tp-cp-ep-dp-pp', got {order!r}")
    text = order.lower()
    for name in ORDER_TOKENS:
        # MCore tests membership on the string, so keep that reading.
        if name not in text:
            if sizes[name] != 1:
                raise RuntimeError(
                    f"order {order!r} does not contain {name!r}, but its size is {sizes[name]}; "
                    f"add {name!r} to order"
                )
            text = f"{text}-{name}"
    tokens = text.split("-")
    for tok in tokens:
        if tok not in ORDER_TOKENS:
            raise KeyError(f"order {order!r} has unknown token {tok!r}; known tokens are {list(ORDER_TOKENS)}")
    dup = sorted({t for t in tokens if tokens.count(t) > 1})
    if dup:
        raise ValueError(f"order {order!r} repeats token(s) {dup}; each token may appear once")
    return tokens


class EmptyGroupError(ValueError, TypeError):
    """A user callable produced an empty group (MCore fails on it with ``TypeError``)."""


def _quotient(world_size: int, **factors: int) -> int:
    """``world_size`` divided by the product of ``factors``; ``RuntimeError`` (as MCore) if it
    does not divide, naming every factor."""
    product = math.prod(factors.values())
    if world_size % product != 0:
        named = " x ".join(f"{name} ({value})" for name, value in factors.items())
        raise RuntimeError(f"world_size ({world_size}) is not divisible by {named} = {product}")
    return world_size // product


@dataclass(frozen=True)
class GroupKind:
    """One kind of process group MCore builds.

    ``name`` is MCore's NCCL config key for it (or a descriptive name), ``desc`` the
    ``group_desc`` MCore gives it, ``view`` the layout it lives in ("decoder"/"expert"/derived).
    """

    name: str
    desc: str
    what: str


GROUP_KINDS: dict[str, GroupKind] = {
    k.name: k
    for k in [
        GroupKind("dp_cp", "DATA_PARALLEL_GROUP_WITH_CP", "data parallel with context parallel (dp × cp)"),
        GroupKind("intra_dp_cp", "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "one distributed-optimizer instance's share of dp × cp"),
        GroupKind("dp", "DATA_PARALLEL_GROUP", "data parallel"),
        GroupKind("cp", "CONTEXT_PARALLEL_GROUP", "context parallel"),
        GroupKind("mp", "MODEL_PARALLEL_GROUP", "model parallel (tp × pp)"),
        GroupKind("tp", "TENSOR_MODEL_PARALLEL_GROUP", "tensor model parallel"),
        GroupKind("pp", "PIPELINE_MODEL_PARALLEL_GROUP", "pipeline model parallel"),
        GroupKind("embd", "EMBEDDING_GROUP", "word-embedding stages of a pipeline"),
        GroupKind("pos_embd", "POSITION_EMBEDDING_GROUP", "position-embedding stages of a pipeline"),
        GroupKind("tp_dp_cp", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "tp × dp × cp"),
        GroupKind("tp_dp", "TENSOR_AND_DATA_PARALLEL_GROUP", "tp × dp"),
        GroupKind("tp_cp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP", "tp × cp"),
        GroupKind("ep", "EXPERT_MODEL_PARALLEL_GROUP", "expert model parallel"),
        GroupKind("ep_tp", "EXPERT_TENSOR_PARALLEL_GROUP", "expert tensor parallel"),
        GroupKind("tp_ep_mp", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "expert tp × ep"),
        GroupKind("tp_ep_pp", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "expert tp × ep × pp"),
        GroupKind("ep_dp", "EXPERT_DATA_PARALLEL_GROUP", "expert data parallel"),
        GroupKind("intra_ep_dp", "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0", "one distributed-optimizer instance's share of expert dp"),
        GroupKind("inter_ep_dp", "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1", "expert dp across distributed-optimizer instances"),
        GroupKind("intra_dist_opt_instance", "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", "all ranks of one distributed-optimizer instance"),
    ]
}


@dataclass
class MegatronLayout:
    """The layout ``initialize_model_parallel`` would build, as pure math.

    Sizes use MCore's argument names. ``order`` is read as MCore reads it. Validation follows
    MCore's checks and exception types (``RuntimeError`` for an indivisible world or a size > 1
    missing from ``order``, ``AssertionError`` for its asserted conditions), with messages
    that name the argument and its value.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    order: str = "tp-cp-ep-dp-pp"
    num_distributed_optimizer_instances: int = 1
    hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None
    get_embedding_ranks: Optional[Callable] = None
    get_position_embedding_ranks: Optional[Callable] = None
    decoder: Layout = field(init=False, repr=False)
    expert: Layout = field(init=False, repr=False)

    def __post_init__(self) -> None:
        w = self.world_size
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        ep = self.expert_model_parallel_size
        self.data_parallel_size = _quotient(
            w, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
        dense = {"tp": tp, "pp": pp, "dp": self.data_parallel_size, "ep": 1, "cp": cp}
        self.order_tokens = normalize_order(self.order, dense)
        self.decoder = Layout([dense[t] for t in self.order_tokens], self.order_tokens)

        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = tp
        etp = self.expert_tensor_parallel_size
        self.expert_data_parallel_size = _quotient(
            w, expert_tensor_parallel_size=etp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp
        )
        moe = {"tp": etp, "pp": pp, "dp": self.expert_data_parallel_size, "ep": ep, "cp": 1}
        expert_tokens = normalize_order(self.order, moe)
        self.expert = Layout([moe[t] for t in expert_tokens], expert_tokens)

        if not (self.order.endswith("pp") or pp == 1 or self.expert_data_parallel_size == self.data_parallel_size):
            raise AssertionError(
                f"order {self.order!r} does not end with 'pp', so the data parallel size of the dense "
                f"layers ({self.data_parallel_size}) and of the expert layers "
                f"({self.expert_data_parallel_size}) must be equal"
            )
        if not self.decoder.same_groups("pp", self.expert):
            raise AssertionError(
                f"pipeline groups differ between the dense and the expert layout for order {self.order!r}: "
                f"{self.decoder.enumerate_groups('pp')[0].tolist()} vs {self.expert.enumerate_groups('pp')[0].tolist()} "
                f"(first group); choose an order ending in 'pp' or matching tensor sizes"
            )

        n = self.num_distributed_optimizer_instances
        dp_cp = self.data_parallel_size * cp
        if dp_cp % n != 0:
            raise AssertionError(
                f"data_parallel_size x context_parallel_size ({self.data_parallel_size} x {cp} = {dp_cp}) "
                f"is not divisible by num_distributed_optimizer_instances ({n})"
            )
        self.intra_partial_data_parallel_size = dp_cp // n
        self._intra_dp_cp = self.decoder.split(["cp", "dp"], [dp_cp // n, n], ["intra_dp_cp", "inter_dp_cp"])

        hcp = self.hierarchical_context_parallel_sizes
        self._hcp: Optional[Layout] = None
        if hcp:
            sizes = list(hcp)
            if math.prod(sizes) != cp:
                raise AssertionError(
                    f"hierarchical_context_parallel_sizes {sizes} multiply to {math.prod(sizes)}, "
                    f"not context_parallel_size ({cp})"
                )
            self._hcp = self.decoder.split("cp", sizes, [f"hcp{i}" for i in range(len(sizes))])

        edp = self.expert_data_parallel_size
        if edp % n != 0:
            raise AssertionError(
                f"expert data parallel size ({edp}) is not divisible by num_distributed_optimizer_instances ({n})"
            )
        self.intra_partial_expert_data_parallel_size = edp // n
        self._edp_split = self.expert.split("dp", [edp // n, n], ["intra_ep_dp", "inter_ep_dp"])
        if self.get_embedding_ranks is None:
            self.get_embedding_ranks = default_embedding_ranks
        if self.get_position_embedding_ranks is None:
            self.get_position_embedding_ranks = default_position_embedding_ranks

    # ----------------------------------------------------------------- kinds
    _DECODER_DIMS = {
        "dp_cp": ("dp", "cp"),
        "dp": ("dp",),
        "cp": ("cp",),
        "mp": ("tp", "pp"),
        "tp": ("tp",),
        "pp": ("pp",),
        "tp_dp_cp": ("tp", "dp", "cp"),
        "tp_dp": ("tp", "dp"),
        "tp_cp": ("tp", "cp"),
    }
    _EXPERT_DIMS = {
        "ep": ("ep",),
        "ep_tp": ("tp",),
        "tp_ep_mp": ("tp", "ep"),
        "tp_ep_pp": ("tp", "ep", "pp"),
        "ep_dp": ("dp",),
    }

    @property
    def hierarchical_levels(self) -> int:
        """Number of hierarchical context-parallel levels (0 when not configured)."""
        return 0 if self._hcp is None else len(self.hierarchical_context_parallel_sizes)

    def kinds(self) -> list[str]:
        """Every group kind of this configuration, in MCore's creation order."""
        out = ["dp_cp"]
        if self.num_distributed_optimizer_instances > 1:
            out.append("intra_dp_cp")
        out += ["dp", "cp"]
        out += [f"hcp{i}" for i in range(self.hierarchical_levels)]
        out += ["mp", "tp", "pp", "embd", "pos_embd", "tp_dp_cp", "tp_dp", "tp_cp"]
        out += ["ep", "ep_tp", "tp_ep_mp", "tp_ep_pp", "ep_dp"]
        if self.num_distributed_optimizer_instances > 1:
            out += ["intra_ep_dp", "inter_ep_dp"]
        out.append("intra_dist_opt_instance")
        return out

    def group(self, kind: str, rank: int) -> Optional[list[int]]:
        """``rank``'s group of ``kind`` in MCore's order, or ``None`` if it is in none.

        O(group size). Only ``embd`` / ``pos_embd`` can be ``None`` (ranks that hold no
        embedding).
        """
        if kind in self._DECODER_DIMS:
            return self.decoder.group_ranks(rank, self._DECODER_DIMS[kind])
        if kind in self._EXPERT_DIMS:
            return self.expert.group_ranks(rank, self._EXPERT_DIMS[kind])
        if kind == "intra_dp_cp":
            return self._intra_dp_cp.group_ranks(rank, "intra_dp_cp")
        if kind.startswith("hcp") and self._hcp is not None and kind[3:].isdigit():
            if int(kind[3:]) < self.hierarchical_levels:
                return self._hcp.group_ranks(rank, kind)
        if kind in ("intra_ep_dp", "inter_ep_dp"):
            return self._edp_split.group_ranks(rank, kind)
        if kind == "intra_dist_opt_instance":
            dims = self._edp_split.dims(["tp", "ep", "pp"]) + ("intra_ep_dp",)
            return self._edp_split.group_ranks(rank, dims, keep_order=True)
        if kind in ("embd", "pos_embd"):
            members = self.embedding_ranks(kind, self.group("pp", rank))
            return members if rank in members else None
        raise KeyError(f"unknown group kind {kind!r}; kinds of this layout: {self.kinds()}")

    def embedding_ranks(self, kind: str, pp_ranks: list[int]) -> list[int]:
        """The embedding (``embd``) or position-embedding (``pos_embd``) ranks of one pipeline.

        The user callable must return a subset of ``pp_ranks``: a rank can then find its
        embedding group from its own pipeline alone.
        """
        fn = self.get_embedding_ranks if kind == "embd" else self.get_position_embedding_ranks
        arg = "get_embedding_ranks" if kind == "embd" else "get_position_embedding_ranks"
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

    def hybrid_group(self, rank: int, group_size: int) -> list[int]:
        """``rank``'s hybrid dp×cp group of ``group_size``: a chunk of its dp-cp group."""
        ranks = self.group("dp_cp", rank)
        start = (ranks.index(rank) // group_size) * group_size
        return ranks[start : start + group_size]

    def hybrid_group_sizes(self) -> list[int]:
        """The hybrid dp×cp group sizes MCore creates: powers of two from 2 below dp×cp."""
        n = self.data_parallel_size * self.context_parallel_size
        return [2**i for i in range(1, int(math.log2(n)))] if n > 0 else []

    def enumerate(self, kind: str) -> list[list[int]]:
        """All groups of ``kind`` (O(world size); for tools and tests, not the init path)."""
        if kind in self._DECODER_DIMS:
            return self.decoder.rank_enum(self._DECODER_DIMS[kind])
        if kind in self._EXPERT_DIMS:
            return self.expert.rank_enum(self._EXPERT_DIMS[kind])
        if kind in ("embd", "pos_embd"):
            return [self.embedding_ranks(kind, g) for g in self.decoder.rank_enum("pp")]
        seen: set[int] = set()
        groups = []
        for r in range(self.world_size):
            if r in seen:
                continue
            g = self.group(kind, r)
            seen.update(g)
            groups.append(g)
        return groups
