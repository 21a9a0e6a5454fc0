"""Megatron-Core's process-group kinds as pure layout math, for every supported release.

:class:`MegatronLayout` gives, for one ``initialize_model_parallel`` configuration of one release
(0.12 … 0.19), any rank's group of any kind in closed form (O(group size), MCore's in-group
order): the dense layout ``tp, cp, dp, pp``, the expert layout ``etp, ep, edp, pp`` and the
derived kinds (:mod:`parallel_state_ng.layout.kinds`), with 0.17's rank range, 0.19's GTP axes
and 0.12/0.13's encoder block (:mod:`parallel_state_ng.layout.encoder_layout`). No
``torch.distributed``. See docs/architecture.md and docs/releases.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from parallel_state_ng.layout.encoder_layout import EncoderBlock, encoder_data_parallel_size, resolve_encoder_sizes
from parallel_state_ng.layout.kinds import ALL_GATHER_KINDS, GROUP_KINDS, token_kind_dims
from parallel_state_ng.layout.megatron_blocks import block_data_parallel_size, block_layout, split_blocks
from parallel_state_ng.layout.megatron_checks import (
    check_layout_arguments,
    check_rank_offset,
    check_split_rank,
    checked_embedding_ranks,
)
from parallel_state_ng.layout.named_layout import Layout
from parallel_state_ng.layout.order import (
    DEFAULT_ORDER,
    GTP_TOKEN,
    ORDER_TOKENS,
    EmptyGroupError,
    default_embedding_ranks,
    default_position_embedding_ranks,
    hierarchical_group,
    normalize_order,
    read_order,
)
from parallel_state_ng.layout.plan import creation_kinds
from parallel_state_ng.releases.facts import ReleaseFacts, release_facts

__all__ = [
    "MegatronLayout",
    "GROUP_KINDS",
    "ORDER_TOKENS",
    "normalize_order",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "EmptyGroupError",
    "SHAPE_ARGUMENTS",
]

#: The ``initialize_model_parallel`` arguments a :class:`MegatronLayout` takes as they are, in
#: every release and for a module on a part of the world alike (the rank range and the 0.12/0.13
#: encoder arguments come on top).
SHAPE_ARGUMENTS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "order",
    "num_distributed_optimizer_instances",
    "hierarchical_context_parallel_sizes",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
    "gtp_remat_size",
    "expert_gtp_remat_size",
)


@dataclass
class MegatronLayout:
    """The layout ``initialize_model_parallel`` of one release would build, as pure math.

    Sizes use MCore's argument names. ``world_size`` is the number of ranks of the job;
    ``local_world_size`` (0.17+) the number the layout covers, from ``rank_offset`` (0.17+).
    ``release`` is the series mirrored (``"0.19"``; ``None``: the selected release, see
    :func:`parallel_state_ng.releases.current_release`). ``order`` is read as that release
    reads it. Validation follows MCore's checks and exception types (``RuntimeError`` for an
    indivisible world or a size > 1 missing from ``order``, ``AssertionError`` for its asserted
    conditions), with messages that name the argument and its value; arguments the release
    does not have raise ``TypeError``.

    0.19's GTP axis ``gtp_remat`` comes after ``tp`` in the dense layout (size
    ``gtp_remat_size``) and after ``ep`` in the expert one (``expert_gtp_remat_size``); with
    GTP sizes 1 a 0.19 layout has 0.18's groups.

    Ranks outside ``[rank_offset, rank_offset + local_world_size)`` are in no group:
    :meth:`group` returns ``None`` for them.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    order: str = DEFAULT_ORDER
    num_distributed_optimizer_instances: int = 1
    hierarchical_context_parallel_sizes: Sequence[int] | None = None
    get_embedding_ranks: Callable | None = None
    get_position_embedding_ranks: Callable | None = None
    rank_offset: int = 0
    local_world_size: int | None = None
    gtp_remat_size: int = 1
    expert_gtp_remat_size: int = 1
    encoder_tensor_model_parallel_size: int = 0
    encoder_pipeline_model_parallel_size: int | None = 0
    pipeline_model_parallel_split_rank: int | None = None
    release: str | None = None
    decoder: Layout = field(init=False, repr=False)
    expert: Layout = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Checks that need no derived size, then the blocks (BLOCKS) in MCore's order of
        # derivation, each size checked as it is derived, then the optimizer-instance splits.
        self._check_release_arguments()
        tp, cp, n = (
            self.tensor_model_parallel_size,
            self.context_parallel_size,
            self.num_distributed_optimizer_instances,
        )
        gtp, egtp, axis = self.gtp_remat_size, self.expert_gtp_remat_size, bool(self.facts.gtp_remat_axis)
        if self.facts.gtp_requires_single_instance and (gtp > 1 or egtp > 1) and n > 1:
            raise AssertionError(
                f"gtp_remat_size ({gtp}) / expert_gtp_remat_size ({egtp}) > 1 needs "
                f"num_distributed_optimizer_instances == 1, got {n}"
            )
        w, pp = self.layout_world_size, self.pipeline_model_parallel_size
        what = "local_world_size" if self.local_world_size is not None else "world_size"
        enc_tp, enc_pp = resolve_encoder_sizes(
            self.encoder_tensor_model_parallel_size, self.encoder_pipeline_model_parallel_size, tp
        )
        self.encoder_tensor_model_parallel_size, self.encoder_pipeline_model_parallel_size = enc_tp, enc_pp
        if enc_tp * enc_pp:  # 0.12-0.13: an encoder block first
            self.data_parallel_size = encoder_data_parallel_size(w, what, enc_tp, enc_pp, tp, pp, cp)
        else:
            self.data_parallel_size = block_data_parallel_size(self, "decoder", w, what, axis)
        #: Ranks of the encoder block ``[rank_offset, rank_offset + encoder_world_size)`` (0.12-0.13).
        self.encoder_world_size = enc_tp * enc_pp * cp * self.data_parallel_size
        encoder = None
        if self.encoder_world_size:
            sizes = {"tp": enc_tp, "pp": enc_pp, "dp": self.data_parallel_size, "ep": 1, "cp": cp}
            tokens = normalize_order(self.order, sizes)
            encoder = Layout([sizes[t] for t in tokens], tokens, self.rank_offset)
        start = self.rank_offset + self.encoder_world_size  # the decoder and expert blocks
        self.decoder = block_layout(self, "decoder", start, axis)
        self.order_tokens = list(self.decoder.names)
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = tp
        expert_what = f"decoder {what}" if encoder else what
        self.expert_data_parallel_size = block_data_parallel_size(
            self, "expert", w - self.encoder_world_size, expert_what, axis
        )
        self.expert = block_layout(self, "expert", start, axis)
        self.encoder_block = None if encoder is None else EncoderBlock(encoder, self.decoder, self.expert)
        self._check_pipelines_agree()
        self._split_optimizer_instances(encoder)
        self._set_embedding_ranks()
        self._kind_dims = self._token_kinds()
        self._all_gather: dict[str, Layout | None] = {}

    def _check_pipelines_agree(self) -> None:
        """The dense and expert blocks must have the same pipelines (MCore asserts it)."""
        pp = self.pipeline_model_parallel_size
        if not (self.order.endswith("pp") or pp == 1 or self.expert_data_parallel_size == self.data_parallel_size):
            raise AssertionError(
                f"order {self.order!r} does not end with 'pp', so the data parallel size of the dense "
                f"layers ({self.data_parallel_size}) and of the expert layers "
                f"({self.expert_data_parallel_size}) must be equal"
            )
        if not self.decoder.same_groups("pp", self.expert):
            raise AssertionError(
                f"pipeline groups differ between the dense and the expert layout for order {self.order!r}: "
                f"{self.decoder.enumerate_groups('pp')[0].tolist()} vs "
                f"{self.expert.enumerate_groups('pp')[0].tolist()} "
                f"(first group); choose an order ending in 'pp' or matching tensor sizes"
            )

    def _split_optimizer_instances(self, encoder: Layout | None) -> None:
        """The partial data-parallel sizes and the blocks split per optimizer instance (SPLITS)."""
        cp, n = self.context_parallel_size, self.num_distributed_optimizer_instances
        dp_cp = self.data_parallel_size * cp
        if dp_cp % n != 0:
            raise AssertionError(
                f"data_parallel_size x context_parallel_size ({self.data_parallel_size} x {cp} = {dp_cp}) "
                f"is not divisible by num_distributed_optimizer_instances ({n})"
            )
        self.intra_partial_data_parallel_size = dp_cp // n
        blocks = {"decoder": self.decoder, **({"encoder": encoder} if encoder else {})}
        self._intra_dp_cp = split_blocks(blocks, "_intra_dp_cp", dp_cp, n)
        hcp = self.hierarchical_context_parallel_sizes
        if hcp and self.facts.hcp_sizes_checked and math.prod(hcp) != cp:
            raise AssertionError(
                f"hierarchical_context_parallel_sizes {list(hcp)} multiply to {math.prod(hcp)}, "
                f"not context_parallel_size ({cp})"
            )
        edp = self.expert_data_parallel_size
        if edp % n != 0 and self.facts.partial_expert_dp:
            raise AssertionError(
                f"expert data parallel size ({edp}) is not divisible by num_distributed_optimizer_instances ({n})"
            )
        self.intra_partial_expert_data_parallel_size = edp // n
        if encoder and n > 1 and self.facts.partial_expert_dp and self.data_parallel_size != edp:
            # MCore splits the encoder's data-parallel groups (size dp) as if they were expert ones.
            raise RuntimeError(
                f"num_distributed_optimizer_instances ({n}) > 1 with an encoder needs the expert data parallel "
                f"size ({edp}) to equal the data parallel size ({self.data_parallel_size}): megatron-core splits "
                f"the encoder's data-parallel groups into expert distributed-optimizer shares"
            )
        # 0.13+: the expert dp shares of the optimizer instances
        shared = self.facts.partial_expert_dp or self.facts.dist_opt_instance_group
        expert_blocks = {"decoder": self.expert, **({"encoder": encoder} if encoder else {})}
        self._edp_split = split_blocks(
            {
                name: block
                for name, block in expert_blocks.items()
                if shared and (name == "decoder" or (n > 1 and self.facts.partial_expert_dp))
            },
            "_edp_split",
            edp,
            n,
        )

    def _set_embedding_ranks(self) -> None:
        """The split rank checked; the embedding callables defaulted (with the split rank, 0.12-0.13)."""
        split = self.pipeline_model_parallel_split_rank
        encoder_stages = self.encoder_pipeline_model_parallel_size or 0  # resolved: an int
        check_split_rank(self, stages=encoder_stages + self.pipeline_model_parallel_size)
        for name, default in (
            ("get_embedding_ranks", default_embedding_ranks),
            ("get_position_embedding_ranks", default_position_embedding_ranks),
        ):
            if getattr(self, name) is None:
                setattr(self, name, default if split is None else functools.partial(default, split_rank=split))

    def _check_release_arguments(self) -> None:
        """Resolve ``release`` and reject arguments it does not have, or bad offsets/sizes."""
        if self.release is None:
            from parallel_state_ng.releases import current_release

            self.release = current_release().series
        self.facts: ReleaseFacts = release_facts(self.release)
        self.release = self.facts.series
        check_layout_arguments(self)

    def shifted(self, rank_offset: int) -> MegatronLayout:
        """This layout on the ranks from ``rank_offset``: equal, group for group, to one built there.

        The offset-dependent parts move (decoder, expert, encoder block, partial-data-parallel and
        expert-share splits); the rest is shared. O(number of dims). Raises as the constructor
        does for an offset the release or the world does not allow.
        """
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)  # a shallow copy
        out.rank_offset = rank_offset
        check_rank_offset(out)
        delta = rank_offset - self.rank_offset
        out.decoder, out.expert = (lay.shifted(lay.rank_offset + delta) for lay in (self.decoder, self.expert))
        if (enc := self.encoder_block) is not None:
            out.encoder_block = EncoderBlock(
                enc.encoder.shifted(enc.encoder.rank_offset + delta), out.decoder, out.expert
            )
        for name in ("_intra_dp_cp", "_edp_split"):  # block name -> split layout
            setattr(out, name, {k: s.shifted(s.rank_offset + delta) for k, s in getattr(self, name).items()})
        out._kind_dims, out._all_gather = out._token_kinds(), {}
        return out

    # ----------------------------------------------------------------- kinds
    @property
    def layout_world_size(self) -> int:
        """Number of ranks the layout covers: ``local_world_size``, else ``world_size``."""
        return self.world_size if self.local_world_size is None else self.local_world_size

    def contains(self, rank: int) -> bool:
        """Whether ``rank`` lies in ``[rank_offset, rank_offset + local_world_size)``."""
        return self.rank_offset <= rank < self.rank_offset + self.layout_world_size

    def _token_kinds(self) -> dict[str, tuple[Layout, tuple[str, ...]]]:
        """Kinds enumerated straight from a rank-generator token: (layout, dims)."""
        views = {"dense": self.decoder, "expert": self.expert}
        return {name: (views[view], dims) for name, (view, dims) in token_kind_dims(self.facts.gtp_remat_axis).items()}

    @property
    def token_kinds(self) -> frozenset[str]:
        """The kinds read straight off a rank-generator token (enumerated in MCore's order)."""
        return frozenset(self._kind_dims)

    @property
    def hierarchical_levels(self) -> int:
        """Number of hierarchical context-parallel levels (0 when not configured)."""
        return len(self.hierarchical_context_parallel_sizes or ())

    @property
    def gtp_active(self) -> bool:
        """Whether a GTP size (dense or expert) is > 1."""
        return self.gtp_remat_size > 1 or self.expert_gtp_remat_size > 1

    def kinds(self) -> list[str]:
        """Every group kind ``initialize_model_parallel`` builds here, in the release's creation order.

        Read from the group plan (:func:`parallel_state_ng.layout.plan.creation_kinds`). Hybrid
        dp×cp groups (:meth:`hybrid_group`) and the all-gather kinds (``dp_cp_ag``, ``ep_dp_ag``)
        are built on request only and are not listed.
        """
        return creation_kinds(self)

    def group(self, kind: str, rank: int) -> list[int] | None:
        """``rank``'s group of ``kind`` in MCore's order, or ``None`` if it is in none.

        O(group size). ``None`` for a rank outside the layout's ranks, for ``embd`` /
        ``pos_embd`` on a rank that holds no embedding, and for an all-gather kind on a rank
        outside that kind's own generator (0.18+, see :meth:`all_gather_layout`).
        """
        if kind in ALL_GATHER_KINDS:
            return self._all_gather_group(kind, rank)
        if not self.contains(rank):
            if kind in self._kind_dims or kind in self.kinds() or kind in GROUP_KINDS:
                return None
            raise KeyError(f"unknown group kind {kind!r}; kinds of this layout: {self.kinds()}")
        enc = self.encoder_block
        block = "encoder" if enc is not None and enc.contains(rank) else "decoder"
        if kind in self._kind_dims:
            lay, dims = self._kind_dims[kind]
            if enc is not None:
                if kind == "pp":
                    return enc.pipelines(rank)[0]
                if kind == "mp":
                    return enc.concatenated(rank, dims)
                if block == "encoder":
                    lay = enc.encoder
            return lay.group_ranks(rank, dims)
        if kind == "intra_dp_cp" or (kind == "inter_dp_cp" and self.facts.inter_partial_dp):
            return self._intra_dp_cp[block].group_ranks(rank, kind)
        if kind.startswith("hcp") and kind[3:].isdigit() and int(kind[3:]) < self.hierarchical_levels:
            sizes = list(self.hierarchical_context_parallel_sizes or ())  # not None: hierarchical_levels > 0
            cp_group = cast("list[int]", self.group("cp", rank))  # a rank of the layout is in a cp group
            return hierarchical_group(cp_group, rank, sizes, int(kind[3:]))
        if kind in ("intra_ep_dp", "inter_ep_dp") and block in self._edp_split:
            return self._edp_split[block].group_ranks(rank, kind)
        if kind == "intra_dist_opt_instance":
            if self.facts.gtp_remat_axis and self.gtp_active:
                # 0.19 with GTP: one group of every rank of the layout (one optimizer instance).
                return list(range(self.rank_offset, self.rank_offset + self.layout_world_size))
            if enc is not None:  # consecutive tp-ep-pp groups of both blocks
                return enc.chunk(
                    rank, self.expert.dims(["tp", "ep", "pp"]), self.intra_partial_expert_data_parallel_size
                )
            split = self._edp_split["decoder"]
            return split.group_ranks(rank, split.dims(["tp", "ep", "pp"]) + ("intra_ep_dp",), keep_order=True)
        if kind in ("embd", "pos_embd"):
            found = self.groups(kind, rank)
            return found[-1] if found else None  # MCore keeps the last one it made
        raise KeyError(f"unknown group kind {kind!r}; kinds of this layout: {self.kinds()}")

    def groups(self, kind: str, rank: int) -> list[list[int]]:
        """Every group of ``kind`` that ``rank`` is in, in MCore's creation order.

        One group (or none) for every kind, except on a 0.12/0.13 encoder rank, which is in
        several stitched pipelines (``pp``) and in the embedding groups of each of them that
        hold it (``embd``, ``pos_embd``; MCore keeps the last in its global, :meth:`group`).
        """
        if kind in ("pp", "embd", "pos_embd") and self.contains(rank):
            # a rank of the layout is in a pp group
            pipelines = (
                self.encoder_block.pipelines(rank)
                if self.encoder_block
                else [cast("list[int]", self.group("pp", rank))]
            )
            if kind == "pp":
                return pipelines
            return [m for m in (self.embedding_ranks(kind, p) for p in pipelines) if rank in m]
        found = self.group(kind, rank)
        return [] if found is None else [found]

    def rank_in_group(self, kind: str, rank: int) -> int | None:
        """Position of ``rank`` in its group of ``kind`` (``None`` when it is in none)."""
        members = self.group(kind, rank)
        return None if members is None else members.index(rank)

    def all_ranks(self, rank: int) -> str:
        """What the release's ``get_all_ranks()`` returns on ``rank``: its in-group ranks joined by ``_``."""
        return "_".join(str(self.rank_in_group(kind, rank) or 0) for kind in self.facts.all_ranks_kinds)

    # --------------------------------------------------------- all-gather kinds
    def all_gather_layout(self, kind: str) -> Layout | None:
        """The layout ``create_all_gather_groups()`` (0.18+) enumerates ``kind`` from.

        That function builds its own rank generator: the default order (with the GTP axis
        injected on 0.19), rank offset 0, and sizes read back from the getters, whose
        data-parallel size includes the GTP axis on 0.19. With a GTP size > 1 this generator
        is larger than the world (MCore then asks ``new_group`` for ranks that do not exist);
        the layout reproduces its ranks as they are. ``None`` before 0.18 (the
        ``dp_cp_ag`` group then has the ranks of ``dp_cp``).
        """
        if kind not in ALL_GATHER_KINDS:
            raise KeyError(f"{kind!r} is not an all-gather kind; those are {list(ALL_GATHER_KINDS)}")
        if not self.facts.all_gather_groups_function:
            return None
        if kind not in self._all_gather:
            axis, dense = self.facts.gtp_remat_axis, kind == "dp_cp_ag"
            gtp = self.gtp_remat_size if dense else self.expert_gtp_remat_size
            tp = self.tensor_model_parallel_size if dense else cast(int, self.expert_tensor_parallel_size)
            dp = (self.data_parallel_size if dense else self.expert_data_parallel_size) * gtp
            ep, cp = (1, self.context_parallel_size) if dense else (self.expert_model_parallel_size, 1)
            sizes = {"tp": tp, "pp": self.pipeline_model_parallel_size, "dp": dp, "ep": ep, "cp": cp}
            if axis:
                sizes[GTP_TOKEN] = gtp
            tokens = read_order(DEFAULT_ORDER, sizes, ("tp" if dense else "ep") if axis else None)
            self._all_gather[kind] = Layout([sizes[t] for t in tokens], tokens)
        return self._all_gather[kind]

    def _all_gather_group(self, kind: str, rank: int) -> list[int] | None:
        lay = self.all_gather_layout(kind)
        if lay is None:
            if kind == "ep_dp_ag":
                raise KeyError(f"megatron-core {self.release} has no {kind!r} group (added in 0.18)")
            return self.group("dp_cp", rank)
        if not lay.contains(rank):
            return None
        return lay.group_ranks(rank, ("dp", "cp") if kind == "dp_cp_ag" else ("dp",))

    # ------------------------------------------------------- derived helpers
    def embedding_ranks(self, kind: str, pp_ranks: list[int]) -> list[int]:
        """The embedding (``embd``) or position-embedding (``pos_embd``) ranks of one pipeline.

        The user callable must return a subset of ``pp_ranks``: a rank can then find its
        embedding group from its own pipeline alone.
        """
        fn = cast(  # both set by __post_init__
            Callable, self.get_embedding_ranks if kind == "embd" else self.get_position_embedding_ranks
        )
        arg = "get_embedding_ranks" if kind == "embd" else "get_position_embedding_ranks"
        return checked_embedding_ranks(fn, arg, pp_ranks)

    def hybrid_group(self, rank: int, group_size: int) -> list[int] | None:
        """``rank``'s hybrid dp×cp group of ``group_size``: a chunk of its dp-cp group (0.16+).

        ``None`` for a rank outside the layout.
        """
        ranks = self.group("dp_cp", rank)
        if ranks is None:
            return None
        start = (ranks.index(rank) // group_size) * group_size
        return ranks[start : start + group_size]

    def hybrid_group_sizes(self) -> list[int]:
        """The hybrid dp×cp group sizes MCore creates: powers of two from 2 below dp×cp."""
        n = self.data_parallel_size * self.context_parallel_size
        return [2**i for i in range(1, int(math.log2(n)))] if n > 0 else []

    def enumerate(self, kind: str) -> list[list[int]]:
        """All groups of ``kind`` (O(world size); for tools and tests, not the init path).

        Token kinds come in the order of MCore's ``get_ranks``; derived kinds in the order of
        the first rank of each group (MCore may create ``intra_dp_cp``, ``intra_ep_dp`` and
        ``inter_ep_dp`` in another order: compare those as sets of groups).
        """
        enc = self.encoder_block
        if kind in self._kind_dims:
            lay, dims = self._kind_dims[kind]
            if enc is None:
                return lay.rank_enum(dims)
            if kind == "pp":
                return enc.all_pipelines()
            if kind == "mp":
                return enc.all_concatenated(dims)
            return enc.encoder.rank_enum(dims) + lay.rank_enum(dims)
        if kind in ("embd", "pos_embd"):
            return [self.embedding_ranks(kind, g) for g in self.enumerate("pp")]
        if kind in ALL_GATHER_KINDS:
            ag_layout = self.all_gather_layout(kind)
            if ag_layout is not None:
                return ag_layout.rank_enum(("dp", "cp") if kind == "dp_cp_ag" else ("dp",))
            if kind == "ep_dp_ag":
                raise KeyError(f"megatron-core {self.release} has no {kind!r} group (added in 0.18)")
            return self.enumerate("dp_cp")
        seen: set[int] = set()
        groups = []
        for r in range(self.rank_offset, self.rank_offset + self.layout_world_size):
            if r in seen:
                continue
            g = self.group(kind, r)
            if g is not None:  # None: 0.12 hierarchical levels that do not cover every rank
                seen.update(g)
                groups.append(g)
        return groups
