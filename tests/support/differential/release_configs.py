"""Release-specific configuration families for the differential test.

Used by :mod:`tests.support.differential.plans`. Every configuration here passes an argument or
calls a function only some releases have, so :func:`configs.applies` keeps it exactly where the
reference has them: :func:`hand_written_recent` (0.17+ to 0.19); :func:`hand_written_legacy`,
:func:`random_encoder_config` and :func:`random_legacy_extras` (0.12/0.13, the encoder/decoder
era; the arithmetic is :mod:`tests.support.differential.legacy_layout`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tests.support.differential import configs as C
from tests.support.differential.legacy_layout import ENC_PP, ENC_TP, SPLIT


def _split_choices(rng: random.Random, stages: int) -> int:
    """A split rank for pipelines of ``stages`` stages: inside, at the ends, beyond, negative."""
    return rng.choice([0, 1, stages // 2, stages - 1, stages - 1, stages, stages + 2, -1])


def random_legacy_extras(rng: random.Random, kw: dict[str, Any]) -> None:
    """Legacy arguments without an encoder block, added to an ordinary random configuration:
    encoder pp ``None``, an encoder tp with encoder pp 0 (no block; still at most tp), a split rank.
    """
    tp, pp = kw["tensor_model_parallel_size"], kw["pipeline_model_parallel_size"]
    if rng.random() < 0.15:
        r = rng.random()
        if r < 0.35:
            kw[ENC_PP] = None
        elif r < 0.75:
            kw[ENC_TP] = rng.choice(C._divisors(tp))
            if rng.random() < 0.3:
                kw[ENC_PP] = 0
        elif r < 0.9:
            kw[ENC_TP], kw[ENC_PP] = 0, 0  # the defaults, passed explicitly (0.13: no warning)
        else:
            kw[ENC_TP] = 2 * tp  # more encoder tp than tp: MCore asserts even without an encoder
    if rng.random() < 0.15:
        kw[SPLIT] = _split_choices(rng, pp) if pp > 1 else rng.choice([0, 0, 1])


def _encoder_candidates(w: int) -> list[tuple[int, int, int, int, int]]:
    """``(tp, pp, cp, enc_tp, enc_pp)`` with ``(enc_tp * enc_pp + tp * pp) * cp`` dividing ``w``."""
    out = []
    for cp in (1, 2, 4):
        for tp in range(1, 9):
            for pp in range(1, 9):
                for enc_tp in range(1, tp + 1):
                    for enc_pp in range(1, 5):
                        total = (enc_tp * enc_pp + tp * pp) * cp
                        if total <= w and w % total == 0:
                            out.append((tp, pp, cp, enc_tp, enc_pp))
    return out


def random_encoder_config(rng: random.Random, w: int) -> C.Config | None:
    """A seeded random configuration with an encoder block on ``w`` ranks (``None``: none fits)."""
    candidates = _encoder_candidates(w)
    if not candidates:
        return None
    uneven = [c for c in candidates if c[0] % c[3]]  # tp not a multiple of encoder tp: stitching remainder
    tp, pp, cp, enc_tp, enc_pp = rng.choice(uneven if uneven and rng.random() < 0.3 else candidates)
    dp = w // ((enc_tp * enc_pp + tp * pp) * cp)
    decoder_world = tp * pp * cp * dp
    etp = rng.choice(C._divisors(decoder_world // pp, 8)) if rng.random() < 0.3 else None
    ep = rng.choice(C._divisors(decoder_world // (pp * (etp or tp)), 8)) if rng.random() < 0.5 else 1
    edp = decoder_world // (pp * ep * (etp or tp))
    kw: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
        ENC_PP: enc_pp,
        "create_gloo_process_groups": False,
    }
    if enc_tp != tp or rng.random() < 0.5:
        kw[ENC_TP] = 0 if enc_tp == tp and rng.random() < 0.5 else enc_tp
    if etp is not None:
        kw["expert_tensor_parallel_size"] = etp
    # an order naming every size > 1 (now and then any order: MCore rejects a missing token), pp
    # last where expert and dense data-parallel sizes differ (MCore asserts that, mostly)
    needed = {
        t
        for t, size in (
            ("tp", max(tp, etp or 1)),
            ("cp", cp),
            ("ep", ep),
            ("dp", max(dp, edp)),
            ("pp", max(pp, enc_pp)),
        )
        if size > 1
    }
    orders = C.COMMON_ORDERS if rng.random() < 0.7 else C.ALL_ORDERS
    if rng.random() < 0.95:
        orders = [o for o in orders if needed <= set(o.split("-"))] or C.ALL_ORDERS
        if pp > 1 and edp != dp and rng.random() < 0.85:
            orders = [o for o in orders if o.endswith("pp")] or orders
    order = rng.choice(orders)
    if order != "tp-cp-ep-dp-pp" or rng.random() < 0.2:
        kw["order"] = order
    if pp > 1 and rng.random() < 0.3:
        kw["virtual_pipeline_model_parallel_size"] = rng.choice([2, 3])
    if cp > 1 and rng.random() < 0.3:
        kw["hierarchical_context_parallel_sizes"] = [2, cp // 2] if cp == 4 and rng.random() < 0.6 else [cp]
    if rng.random() < 0.2:
        common = [d for d in C._divisors(math.gcd(dp * cp, edp)) if d > 1]
        if common:
            kw["num_distributed_optimizer_instances"] = rng.choice(common)
    if rng.random() < 0.25:
        kw[SPLIT] = _split_choices(rng, enc_pp + pp)
    if rng.random() < 0.15:
        kw["get_embedding_ranks"] = C.EMBEDDING_CALLABLES[
            rng.choice(["last", "all", "even", "middle", "first_and_second"])
        ]
    if rng.random() < 0.1:
        kw["get_position_embedding_ranks"] = C.EMBEDDING_CALLABLES[rng.choice(["last", "all", "middle"])]
    if rng.random() < 0.1:
        kw["distributed_timeout_minutes"] = rng.choice([5, 120])
    if C.has("high_priority_stream_groups") and rng.random() < 0.05:
        kw["high_priority_stream_groups"] = rng.choice([["zz"], ["tp"]])
    return C.Config(w, kw)


def hand_written_recent(
    c: Callable[..., C.Config], bad: Callable[..., C.Config], ag: Callable[..., Any]
) -> list[C.Config]:
    """0.17-0.19 edge cases (``c``/``bad``/``ag`` are :func:`plans._hand_written`'s factories).

    0.19's GTP weight-rematerialization sizes, 0.17+'s layout on part of the world
    (``rank_offset`` / ``local_world_size``), 0.18+'s all-gather groups after init.
    """
    return [
        # 0.19: the GTP weight-rematerialization axis (dense after tp, expert after ep)
        c(8, gtp_remat_size=2),
        c(8, expert_gtp_remat_size=2, expert_model_parallel_size=2),
        c(
            16,
            tensor_model_parallel_size=2,
            gtp_remat_size=2,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
        ),
        c(
            32,
            tensor_model_parallel_size=2,
            gtp_remat_size=2,
            context_parallel_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
            expert_gtp_remat_size=2,
        ),
        c(16, gtp_remat_size=4, expert_gtp_remat_size=2, expert_model_parallel_size=2, order="tp-cp-ep-pp-dp"),
        c(16, gtp_remat_size=2, tensor_model_parallel_size=2, order="tp-cp-ep-gtp_remat-dp-pp"),
        c(8, gtp_remat_size=2, order="TP-CP-EP-DP-PP"),
        c(8, gtp_remat_size=2, expert_gtp_remat_size=2, create_gloo_process_groups=True, tag="gloo-forced-off"),
        c(
            1024,
            tensor_model_parallel_size=4,
            gtp_remat_size=2,
            pipeline_model_parallel_size=4,
            expert_model_parallel_size=8,
            expert_tensor_parallel_size=1,
            expert_gtp_remat_size=2,
        ),
        bad(16, gtp_remat_size=2, num_distributed_optimizer_instances=2),
        bad(16, expert_gtp_remat_size=2, num_distributed_optimizer_instances=2),
        bad(8, gtp_remat_size=3),
        bad(8, expert_gtp_remat_size=16),
        c(8, gtp_remat_size=1, expert_gtp_remat_size=1, num_distributed_optimizer_instances=2),
        # 0.17+: a layout on part of the world (both generators offset)
        c(16, local_world_size=8, rank_offset=8, tensor_model_parallel_size=2),
        c(16, local_world_size=8, rank_offset=0, pipeline_model_parallel_size=2, expert_model_parallel_size=2),
        c(16, local_world_size=8, rank_offset=5, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        c(16, local_world_size=16, rank_offset=0, tensor_model_parallel_size=4),
        c(12, local_world_size=4, rank_offset=6, tensor_model_parallel_size=2, context_parallel_size=2),
        c(
            1024,
            local_world_size=512,
            rank_offset=512,
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=4,
            expert_model_parallel_size=4,
        ),
        c(
            16,
            local_world_size=8,
            rank_offset=8,
            gtp_remat_size=2,
            expert_gtp_remat_size=2,
            expert_model_parallel_size=2,
        ),
        bad(8, rank_offset=4, tag="offset-without-local-world"),
        bad(8, local_world_size=16, tag="local-world-beyond-world"),
        c(8, local_world_size=3, tensor_model_parallel_size=2, invalid=True),
        # 0.18+: all-gather groups made after init
        c(8, tensor_model_parallel_size=2, after=(ag(),)),
        c(16, expert_model_parallel_size=4, after=(ag(for_expert_parallelism=True),)),
        c(
            16,
            context_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=2,
            pipeline_model_parallel_size=2,
            after=(ag(for_expert_parallelism=True, timeout=timedelta(minutes=3)),),
        ),
        c(8, after=(ag(for_expert_parallelism=True), ag())),
        c(
            16,
            local_world_size=8,
            rank_offset=8,
            expert_model_parallel_size=2,
            after=(ag(for_expert_parallelism=True),),
        ),
        c(
            16,
            gtp_remat_size=2,
            expert_gtp_remat_size=2,
            expert_model_parallel_size=2,
            after=(ag(for_expert_parallelism=True),),
        ),
        c(8, tensor_model_parallel_size=2, after=(ag(nccl_comm_cfgs={"dp_cp": {"max_ctas": 2}}),)),
    ]


def hand_written_legacy(c: Callable[..., C.Config], bad: Callable[..., C.Config]) -> list[C.Config]:
    """The 0.12/0.13 edge cases (``c``/``bad`` are :func:`plans._hand_written`'s factories)."""
    emb = C.EMBEDDING_CALLABLES
    enc = {ENC_TP: 1, ENC_PP: 1}
    return [
        # MCore's generator_wrapper docstring: 6 ranks, encoder tp 1 pp 1, decoder tp 2 pp 1, dp 2
        c(6, tensor_model_parallel_size=2, order="tp-dp-pp", **enc),
        c(6, tensor_model_parallel_size=2, order="tp-dp-pp", pipeline_model_parallel_split_rank=1, **enc),
        # encoder tp 0 means the decoder's; encoder pp None means 0; explicit zeros; tp only
        c(8, tensor_model_parallel_size=2, encoder_pipeline_model_parallel_size=1),
        c(
            8,
            pipeline_model_parallel_size=2,
            encoder_tensor_model_parallel_size=0,
            encoder_pipeline_model_parallel_size=2,
        ),
        c(8, tensor_model_parallel_size=2, encoder_pipeline_model_parallel_size=None),
        c(8, encoder_tensor_model_parallel_size=0, encoder_pipeline_model_parallel_size=0),
        c(8, tensor_model_parallel_size=2, encoder_tensor_model_parallel_size=2),
        c(8, tensor_model_parallel_size=4, pipeline_model_parallel_size=2, encoder_tensor_model_parallel_size=1),
        # more encoder tp than decoder tp (AssertionError, with and without an encoder block);
        # a total model size that does not divide the world (RuntimeError)
        bad(8, encoder_tensor_model_parallel_size=2, encoder_pipeline_model_parallel_size=1),
        bad(8, tensor_model_parallel_size=2, encoder_tensor_model_parallel_size=4),
        bad(8, tensor_model_parallel_size=2, **enc),
        bad(12, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, encoder_pipeline_model_parallel_size=2),
        # tp not a multiple of the encoder tp: the pipeline stitching has a remainder
        c(
            24,
            tensor_model_parallel_size=3,
            pipeline_model_parallel_size=2,
            encoder_tensor_model_parallel_size=2,
            encoder_pipeline_model_parallel_size=1,
        ),
        c(
            20,
            tensor_model_parallel_size=3,
            encoder_tensor_model_parallel_size=2,
            encoder_pipeline_model_parallel_size=1,
        ),
        c(
            22,
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=2,
            encoder_tensor_model_parallel_size=3,
            encoder_pipeline_model_parallel_size=1,
            order="tp-pp-dp",
        ),
        # distributed optimizer instances with an encoder: the instance groups are chunks of the
        # tp-ep-pp enumeration, which runs over the encoder block and then the decoder block
        c(12, pipeline_model_parallel_size=2, num_distributed_optimizer_instances=2, **enc),
        c(
            24,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            encoder_tensor_model_parallel_size=1,
            encoder_pipeline_model_parallel_size=2,
            num_distributed_optimizer_instances=2,
        ),
        c(
            12,
            num_distributed_optimizer_instances=2,
            pipeline_model_parallel_size=2,
            tensor_model_parallel_size=2,
            encoder_pipeline_model_parallel_size=2,
            encoder_tensor_model_parallel_size=1,
            order="tp-cp-ep-pp-dp",
        ),
        # ... 0.13 splits the encoder's dp groups with the expert data-parallel sizes: einops fails
        # where edp != dp (edp includes cp, dp does not)
        c(16, expert_model_parallel_size=2, num_distributed_optimizer_instances=2, invalid_since="0.13", **enc),
        c(16, num_distributed_optimizer_instances=4, context_parallel_size=2, invalid_since="0.13", **enc),
        # hierarchical context parallelism with an encoder
        c(16, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2], **enc),
        c(
            24,
            tensor_model_parallel_size=2,
            context_parallel_size=2,
            hierarchical_context_parallel_sizes=[2],
            encoder_pipeline_model_parallel_size=1,
        ),
        # expert parallelism with an encoder (expert layout over the decoder block only)
        c(12, tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1, **enc),
        c(16, expert_model_parallel_size=4, **enc),
        c(
            24,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            order="tp-cp-ep-pp-dp",
            encoder_pipeline_model_parallel_size=2,
        ),
        bad(
            20,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
            order="tp-cp-ep-pp-dp",
            **enc,
        ),  # pp not last, edp != dp
        c(
            1024,
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=4,
            expert_model_parallel_size=8,
            encoder_tensor_model_parallel_size=4,
            encoder_pipeline_model_parallel_size=8,
        ),
        # virtual pipeline with an encoder
        c(12, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, **enc),
        c(
            16,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=3,
            encoder_tensor_model_parallel_size=2,
            encoder_pipeline_model_parallel_size=2,
        ),
        # embedding callables and options with an encoder (stitched pipelines)
        c(8, pipeline_model_parallel_size=2, encoder_pipeline_model_parallel_size=2, get_embedding_ranks=emb["all"]),
        c(
            12,
            pipeline_model_parallel_size=2,
            get_embedding_ranks=emb["middle"],
            get_position_embedding_ranks=emb["last"],
            **enc,
        ),
        c(12, context_parallel_size=2, tensor_model_parallel_size=2, distributed_timeout_minutes=5, **enc),
        c(12, pipeline_model_parallel_size=2, order="tp-pp-dp", yaml="other", **enc),
        c(8, use_sharp=True, cuda_stub=True, **enc),
        bad(8, pipeline_model_parallel_comm_backend="ucc", **enc),
        # split rank: default embedding ranks gain the split stage; custom callables ignore it
        c(8, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=2),
        c(8, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=1, get_embedding_ranks=emb["last"]),
        c(
            8,
            pipeline_model_parallel_size=4,
            pipeline_model_parallel_split_rank=2,
            get_position_embedding_ranks=emb["all"],
        ),
        c(8, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=0),
        c(8, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=3),
        c(8, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=-1),
        bad(8, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=4),  # IndexError
        c(
            8,
            pipeline_model_parallel_size=4,
            pipeline_model_parallel_split_rank=4,
            get_embedding_ranks=emb["last"],
            get_position_embedding_ranks=emb["last"],
        ),
        c(8, pipeline_model_parallel_split_rank=0),
        bad(8, pipeline_model_parallel_split_rank=1),
        c(8, pipeline_model_parallel_split_rank=None),
        c(
            16,
            pipeline_model_parallel_size=4,
            virtual_pipeline_model_parallel_size=2,
            pipeline_model_parallel_split_rank=2,
        ),
        # split rank with an encoder (pipelines of encoder pp + pp stages)
        c(
            8,
            pipeline_model_parallel_size=2,
            encoder_pipeline_model_parallel_size=2,
            pipeline_model_parallel_split_rank=2,
        ),
        c(
            12,
            pipeline_model_parallel_size=2,
            pipeline_model_parallel_split_rank=1,
            get_embedding_ranks=emb["even"],
            **enc,
        ),
        bad(12, pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=3, **enc),  # IndexError
    ]
