"""The configuration plan of the differential test: hand-written cases and seeded random ones.

:func:`all_configs` gives the hand-written edge cases (every invalid configuration class
written out, the release-specific families of ``tests/support/differential/release_configs.py``)
and seeded random configurations per world size (:data:`configs.WORLD_PLAN`), each using
only what the *reference* ``megatron.core.parallel_state`` of this process has (see
``tests/support/differential/configs.py``, which defines :class:`Config`).
"""

from __future__ import annotations

import math
import random
from datetime import timedelta
from typing import Any

from tests.support.differential import library as D
from tests.support.differential import release_configs as CR
from tests.support.differential.configs import (
    ALL_ORDERS,
    COMMON_ORDERS,
    EMBEDDING_CALLABLES,
    WORLD_PLAN,
    Config,
    _divisors,
    applies,
    emb_all,
    emb_empty,
    emb_last,
    emb_middle,
    has,
    has_function,
)

AFTER_INIT_CHOICES: tuple[dict[str, Any], ...] = (
    {},
    {"for_expert_parallelism": True},
    {"for_expert_parallelism": True, "timeout": timedelta(minutes=3)},
    {"timeout": timedelta(minutes=7), "nccl_comm_cfgs": {"other": {"max_ctas": 2}}},
)


def _random_config(rng: random.Random, w: int) -> Config:
    """A seeded random configuration on a world of ``w`` ranks, using the reference's parameters.

    Draws for parameters a release lacks are not made, so the configurations of a release
    without them are the same whatever newer releases added.
    """
    if has("encoder_pipeline_model_parallel_size") and rng.random() < 0.3:  # 0.12/0.13: an encoder block
        cfg = CR.random_encoder_config(rng, w)
        if cfg is not None:
            return cfg
    n, extra = w, {}
    if has("local_world_size") and w >= 4 and rng.random() < 0.2:  # a layout on part of the world
        n = rng.choice([d for d in _divisors(w) if d < w and d >= 2])
        extra = {"local_world_size": n, "rank_offset": rng.choice([0, w - n, rng.randrange(0, w - n + 1)])}
    tp = rng.choice(_divisors(n, 8))
    pp = rng.choice(_divisors(n // tp, 8))
    cp = rng.choice(_divisors(n // (tp * pp), 8)) if rng.random() < 0.5 else 1
    gtp = rng.choice(_divisors(n // (tp * pp * cp), 4)) if has("gtp_remat_size") and rng.random() < 0.4 else 1
    dp = n // (tp * pp * cp * gtp)
    etp = rng.choice(_divisors(n // pp, 8)) if rng.random() < 0.4 else None
    ep = rng.choice(_divisors(n // (pp * (etp or tp)), 16)) if rng.random() < 0.6 else 1
    egtp = 1
    if has("expert_gtp_remat_size") and rng.random() < 0.35:
        egtp = rng.choice(_divisors(n // (pp * ep * (etp or tp)), 4))
    edp = n // (pp * ep * (etp or tp) * egtp)
    kw: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
        "create_gloo_process_groups": False,
        **extra,
    }
    if gtp > 1 or (has("gtp_remat_size") and rng.random() < 0.05):
        kw["gtp_remat_size"] = gtp
    if egtp > 1:
        kw["expert_gtp_remat_size"] = egtp
    if etp is not None:
        kw["expert_tensor_parallel_size"] = etp
    # order: common ones, any permutation, tokens of size 1 sometimes left out, case
    r = rng.random()
    order = rng.choice(COMMON_ORDERS) if r < 0.55 else rng.choice(ALL_ORDERS)
    size_one = {
        "tp": tp == 1 and (etp or tp) == 1,
        "cp": cp == 1,
        "ep": ep == 1,
        "dp": dp == 1 and edp == 1,
        "pp": pp == 1,
    }
    tokens = order.split("-")
    if rng.random() < 0.3:
        tokens = [t for t in tokens if not (size_one.get(t) and rng.random() < 0.6)] or tokens
    if rng.random() < 0.03:  # drop a token whose size is > 1: invalid
        big = [t for t in tokens if not size_one.get(t, True)]
        if big:
            tokens.remove(rng.choice(big))
    if has("gtp_remat_size") and rng.random() < 0.1:  # the GTP axis placed by the caller
        tokens.insert(rng.randrange(len(tokens) + 1), "gtp_remat")
    order = "-".join(tokens)
    if rng.random() < 0.05:
        order = order.upper()
    if order != "tp-cp-ep-dp-pp" or rng.random() < 0.2:
        kw["order"] = order
    if pp > 1 and rng.random() < 0.35:
        kw["virtual_pipeline_model_parallel_size"] = rng.choice([1, 2, 3, 4])
    elif pp == 1 and rng.random() < 0.03:
        kw["virtual_pipeline_model_parallel_size"] = 2  # invalid
    if cp > 1 and rng.random() < 0.4:
        factors = [f for f in _divisors(cp) if 1 < f < cp]
        if factors and rng.random() < 0.7:
            a = rng.choice(factors)
            kw["hierarchical_context_parallel_sizes"] = [a, cp // a]
        else:
            kw["hierarchical_context_parallel_sizes"] = [cp]
        if rng.random() < 0.08:
            kw["hierarchical_context_parallel_sizes"] = [cp, 2]  # product != cp: invalid
    if has("hybrid_context_parallel") and rng.random() < 0.08 and w <= 256:
        kw["hybrid_context_parallel"] = True
    if rng.random() < 0.18:
        common = [d for d in _divisors(math.gcd(dp * cp, edp)) if d > 1]
        if common:
            kw["num_distributed_optimizer_instances"] = rng.choice(common)
        elif rng.random() < 0.3:
            kw["num_distributed_optimizer_instances"] = 3 if (dp * cp) % 3 else 5
    if rng.random() < 0.1:
        kw["distributed_timeout_minutes"] = rng.choice([5, 120])
    if has("create_all_gather_group") and rng.random() < 0.15:
        kw["create_all_gather_group"] = True
    if rng.random() < 0.1:
        kw["get_embedding_ranks"] = EMBEDDING_CALLABLES[
            rng.choice(["last", "all", "even", "middle", "first_and_second"])
        ]
    if rng.random() < 0.08:
        kw["get_position_embedding_ranks"] = EMBEDDING_CALLABLES[rng.choice(["last", "all", "even", "middle"])]
    if rng.random() < 0.04:
        kw["pipeline_model_parallel_comm_backend"] = rng.choice(["nccl", "ucc", "nccl"])
    if has("high_priority_stream_groups") and rng.random() < 0.05:
        kw["high_priority_stream_groups"] = rng.choice([["zz"], [], ["tp"], ["dp_cp", "ep_dp"]])
    if has("pipeline_model_parallel_split_rank"):  # 0.12/0.13 arguments without an encoder block
        CR.random_legacy_extras(rng, kw)
    after: tuple[D.Call, ...] = ()
    if has_function("create_all_gather_groups") and rng.random() < 0.3:
        after = tuple(
            D.Call("create_all_gather_groups", dict(rng.choice(AFTER_INIT_CHOICES)))
            for _ in range(1 if rng.random() < 0.85 else 2)
        )
    return Config(w, kw, after_init=after)


def _hand_written() -> list[Config]:
    """Edge cases and every invalid configuration class, written out."""
    base = {"create_gloo_process_groups": False}

    def c(
        w,
        tag="",
        env=None,
        cuda_stub=False,
        yaml=None,
        invalid=False,
        deliberate=None,
        deliberate_arg="",
        after=(),
        invalid_since=None,
        needs_gpu=False,
        needs_nccl_options=False,
        **kw,
    ):
        return Config(
            w,
            {**base, **kw},
            env=env or {},
            cuda_stub=cuda_stub,
            yaml=yaml,
            tag=tag,
            invalid=invalid,
            hand_written=True,
            deliberate=deliberate,
            deliberate_arg=deliberate_arg,
            after_init=after,
            invalid_since=invalid_since,
            needs_gpu=needs_gpu,
            needs_nccl_options=needs_nccl_options,
        )

    def ag(**kw):
        return D.Call("create_all_gather_groups", kw)

    def bad(w, **kw):
        return c(w, invalid=True, **kw)

    cfgs = [
        # defaults and big worlds
        c(1),
        c(2),
        c(8),
        c(1024),
        c(
            1024,
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=8,
            context_parallel_size=2,
            expert_model_parallel_size=16,
        ),
        c(
            1024,
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=4,
            expert_model_parallel_size=8,
            expert_tensor_parallel_size=1,
            num_distributed_optimizer_instances=4,
            order="tp-cp-ep-dp-pp",
        ),
        c(
            512,
            tensor_model_parallel_size=2,
            context_parallel_size=4,
            hierarchical_context_parallel_sizes=[2, 2],
            virtual_pipeline_model_parallel_size=2,
            pipeline_model_parallel_size=4,
        ),
        c(256, context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2, 2], tensor_model_parallel_size=2),
        # hierarchical CP: empty list (falsy: ignored), [1] with cp 1, three levels
        c(8, hierarchical_context_parallel_sizes=[]),
        c(8, hierarchical_context_parallel_sizes=[1]),
        c(16, context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2, 2]),
        c(16, context_parallel_size=4, hierarchical_context_parallel_sizes=[4, 1]),
        # hybrid CP with DPxCP sizes that are not powers of two, and odd (invalid)
        c(6, hybrid_context_parallel=True),
        c(10, hybrid_context_parallel=True),
        c(12, context_parallel_size=2, hybrid_context_parallel=True),
        c(20, tensor_model_parallel_size=2, hybrid_context_parallel=True),
        c(2, hybrid_context_parallel=True),
        bad(3, hybrid_context_parallel=True),
        bad(1, hybrid_context_parallel=True),
        c(32, context_parallel_size=4, hybrid_context_parallel=True, num_distributed_optimizer_instances=2),
        # virtual pipeline
        c(8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1),
        c(8, pipeline_model_parallel_size=8, virtual_pipeline_model_parallel_size=4),
        bad(8, virtual_pipeline_model_parallel_size=2),  # invalid: pp 1
        # embedding callables, including an empty embedding group (invalid on torch)
        *[
            c(8, pipeline_model_parallel_size=4, get_embedding_ranks=f, invalid=f is emb_empty)
            for f in EMBEDDING_CALLABLES.values()
        ],
        *[
            c(8, pipeline_model_parallel_size=4, get_position_embedding_ranks=f, invalid=f is emb_empty)
            for f in EMBEDDING_CALLABLES.values()
        ],
        c(
            16,
            pipeline_model_parallel_size=4,
            virtual_pipeline_model_parallel_size=2,
            get_embedding_ranks=emb_middle,
            get_position_embedding_ranks=emb_last,
        ),
        c(16, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, get_embedding_ranks=emb_all),
        # orders MCore accepts or rejects
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="TP-DP-PP"),
        c(
            8,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            order="tp-cp-ep-dp-pp-pp",
            deliberate="rejects",
            deliberate_arg="order",
        ),
        bad(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-tp-dp-pp"),
        bad(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-xx-dp-pp"),
        bad(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp - dp-pp"),
        bad(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp_dp_pp"),
        bad(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="dp"),
        bad(8, order=""),
        bad(1, order=""),
        # 0.19 injects its GTP axis next to 'tp' and then needs 'tp' in the order
        c(1, order="dp", invalid_since="0.19"),
        c(8, order="dp", invalid_since="0.19"),
        bad(
            16,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
            order="tp-cp-ep-pp-dp",
        ),  # pp not last, edp != dp
        c(
            16,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            order="tp-cp-ep-pp-dp",
        ),  # pp not last, edp == dp
        # indivisible worlds and bad sizes
        bad(8, tensor_model_parallel_size=3),
        bad(12, pipeline_model_parallel_size=8),
        bad(8, expert_tensor_parallel_size=3),
        bad(8, expert_model_parallel_size=3),
        bad(8, tensor_model_parallel_size=16),
        bad(8, tensor_model_parallel_size=0),
        c(16, expert_model_parallel_size=2, context_parallel_size=2),
        # distributed optimizer instances
        bad(8, num_distributed_optimizer_instances=3),
        bad(8, num_distributed_optimizer_instances=0),
        c(8, num_distributed_optimizer_instances=8),
        c(
            8, expert_model_parallel_size=8, num_distributed_optimizer_instances=2, invalid_since="0.13"
        ),  # 0.12 has no expert partial data-parallel groups to check
        c(16, expert_model_parallel_size=4, expert_tensor_parallel_size=2, num_distributed_optimizer_instances=2),
        # hierarchical sizes whose product is not cp (0.12 does not check: it builds the levels that fit)
        c(16, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3], invalid_since="0.13"),
        c(16, context_parallel_size=4, hierarchical_context_parallel_sizes=[8], invalid_since="0.13"),
        # SHARP: MCore's barrier needs torch.cuda (a GPU); with the stub it runs anywhere
        # (0.19 asserts its GTP-remat data-parallel group exists before creating it)
        bad(8, use_sharp=True, needs_gpu=True, invalid_since="0.19"),
        c(8, use_sharp=True, cuda_stub=True, invalid_since="0.19"),
        c(8, use_sharp=True, sharp_enabled_group="dp", cuda_stub=True, invalid_since="0.19"),
        bad(
            16, use_sharp=True, sharp_enabled_group="dp_replica", num_distributed_optimizer_instances=2, needs_gpu=True
        ),
        c(
            16,
            use_sharp=True,
            sharp_enabled_group="dp_replica",
            num_distributed_optimizer_instances=2,
            cuda_stub=True,
            deliberate="barrier-once",
        ),
        c(
            16,
            use_sharp=True,
            sharp_enabled_group="dp_replica",
            num_distributed_optimizer_instances=4,
            expert_model_parallel_size=2,
            cuda_stub=True,
            deliberate="barrier-once",
        ),
        bad(8, use_sharp=True, sharp_enabled_group="dp_replica"),  # invalid: needs dopt > 1
        bad(8, use_sharp=True, sharp_enabled_group="tp"),  # invalid: unknown group
        bad(8, sharp_enabled_group="dp"),  # invalid: without use_sharp
        c(8, cuda_stub=True, env={"NCCL_COLLNET_ENABLE": "1"}),  # MCore clears it at init
        # pipeline communication backend (an NCCL group needs NCCL and a GPU; no UCC anywhere here)
        bad(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="nccl", needs_gpu=True),
        bad(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="ucc"),
        bad(
            8,
            pipeline_model_parallel_size=2,
            pipeline_model_parallel_comm_backend="ucc",
            env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        ),
        bad(
            8,
            pipeline_model_parallel_size=2,
            pipeline_model_parallel_comm_backend="ucc",
            env={"CUDA_DEVICE_MAX_CONNECTIONS": "8", "UCX_TLS": "tcp"},
        ),
        # backend "gloo": the simulated world's stand-in (parallel_state_ng.testing.simulated) creates
        # it, so MCore reaches its own assertion (gloo is not supported for pipeline communication)
        bad(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="gloo"),
        bad(8, pipeline_model_parallel_comm_backend="bogus"),
        # NCCL communicator configs and high-priority streams
        c(8, yaml="other"),
        bad(8, yaml="tp", needs_nccl_options=True),
        bad(8, yaml="empty"),
        bad(8, yaml="absent"),
        c(8, yaml="other", high_priority_stream_groups=["zz"]),
        bad(8, high_priority_stream_groups=["dp_cp"], needs_nccl_options=True),
        c(8, high_priority_stream_groups=[]),
        # timeouts, all-gather group, Megatron's default gloo twins (on the simulated world's
        # fake-backend stand-ins, parallel_state_ng.testing.simulated)
        c(8, distributed_timeout_minutes=1, create_all_gather_group=True, context_parallel_size=2),
        c(8, distributed_timeout_minutes=0, deliberate="rejects", deliberate_arg="distributed_timeout_minutes"),
        c(16, hybrid_context_parallel=True, distributed_timeout_minutes=7),
        Config(8, {"tensor_model_parallel_size": 2}, tag="default-gloo", hand_written=True),
        c(8, create_all_gather_group=None),
        # release-specific families: 0.19 GTP, 0.17+ sub-world, 0.18+ all-gather groups; 0.12/0.13
        # encoder blocks and split ranks (tests/support/differential/release_configs.py)
        *CR.hand_written_recent(c, bad, ag),
        *CR.hand_written_legacy(c, bad),
    ]
    return [cfg for cfg in cfgs if applies(cfg)]


def all_configs(plan: dict[int, int] | None = None, hand_written: bool = True, seed: int = 3) -> list[Config]:
    """Hand-written configurations (if asked), then seeded random ones per ``plan``; ids are unique.

    ``plan`` maps a world size to the number of random configurations (default
    :data:`WORLD_PLAN`).
    """
    rng = random.Random(seed)
    configs: dict[str, Config] = {}
    if hand_written:
        for cfg in _hand_written():
            configs.setdefault(cfg.id, cfg)
    for w, count in (WORLD_PLAN if plan is None else plan).items():
        made = attempts = 0
        while made < count and attempts < 50 * count:
            attempts += 1
            cfg = _random_config(rng, w)
            if cfg.id not in configs:
                configs[cfg.id] = cfg
                made += 1
    return list(configs.values())
