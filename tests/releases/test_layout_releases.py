"""MegatronLayout vs each supported release's own ``initialize_model_parallel`` and ``RankGenerator``.

One subprocess per release (:func:`tests.support.releases.wheels.run_in_release`) runs a seeded batch of
configurations through the release's init with a recording ``torch.distributed`` stand-in and
compares every group it builds with :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`
(see ``layout_release_checks.py``): world sizes up to 1,024, random orders, distributed-optimizer
instances, hierarchical context parallel, hybrid dp×cp (0.16+), ``rank_offset`` /
``local_world_size`` (0.17+), all-gather groups (0.16+), GTP sizes (0.19), and configurations
the release rejects (same exception type).
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.releases import installed_megatron_version, parse_release
from tests.support import rotation
from tests.support.releases.wheels import RELEASES, run_in_release

INSTALLED_SERIES = ".".join((installed_megatron_version() or "").split(".")[:2])

CONFIGS_PER_RELEASE = 24
TOKENS = ("tp", "cp", "ep", "dp", "pp")
# Orders ending in pp that interleave tp, cp and dp (groups differ from the default order's),
# orders with size-1 tokens left out, an upper-case one and permutations not ending in pp.
ORDERS = [
    "tp-cp-ep-dp-pp",
    "cp-tp-ep-dp-pp",
    "dp-tp-cp-ep-pp",
    "cp-dp-tp-ep-pp",
    "tp-dp-cp-ep-pp",
    "ep-tp-dp-cp-pp",
    "tp-dp-pp",
    "tp-pp-dp",
    "TP-CP-EP-DP-PP",
] + ["-".join(p) for p in itertools.permutations(TOKENS)][::23]


def _draw(rng: random.Random, series: str, big: bool) -> dict:
    """One configuration for ``series`` (sizes may be invalid on purpose now and then)."""
    release = parse_release(series)
    gtp = egtp = 1
    if release.at_least("0.19") and rng.random() < 0.7:
        gtp, egtp = rng.choice([1, 2, 2, 4]), rng.choice([1, 1, 2])
    tp, pp, cp = rng.choice([1, 1, 2, 4]), rng.choice([1, 2, 2, 3, 4]), rng.choice([1, 1, 2, 4])
    dp = rng.choice([4, 8, 16]) if big else rng.choice([1, 2, 3, 4, 6])
    local = tp * pp * cp * dp * gtp
    per_stage = local // pp
    egtp = egtp if per_stage % egtp == 0 else 1
    ep = rng.choice([d for d in (1, 2, 4, 8) if per_stage % (d * egtp) == 0])
    etp = rng.choice([None, *[d for d in (1, 2, 4) if per_stage % (d * ep * egtp) == 0]])
    edp = per_stage // ((etp or tp) * ep * egtp) if per_stage % ((etp or tp) * ep * egtp) == 0 else 0
    pp_last = [o for o in ORDERS if o.endswith("pp") and len(o.split("-")) == 5]
    instances = 2 if (gtp, egtp) == (1, 1) and (dp * cp) % 2 == 0 and edp % 2 == 0 and rng.random() < 0.4 else 1
    cfg = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "order": rng.choice(ORDERS if rng.random() < 0.25 else pp_last),
        "num_distributed_optimizer_instances": instances,
        "world_size": local,
    }
    if cp == 4 and rng.random() < 0.7:
        cfg["hierarchical_context_parallel_sizes"] = rng.choice([[2, 2], [4, 1], [1, 2, 2]])
    if release.at_least("0.16"):
        cfg["hybrid_context_parallel"] = (dp * cp) % 2 == 0 and rng.random() < 0.5
        if release.before("0.18"):
            cfg["create_all_gather_group"] = rng.random() < 0.5
    if release.at_least("0.17") and rng.random() < 0.5:
        cfg["rank_offset"] = rng.choice([1, 2, local // 2 + 1, local])
        cfg["local_world_size"] = local
        cfg["world_size"] = cfg["rank_offset"] + local + rng.choice([0, 0, 3])
    if release.at_least("0.19"):
        cfg["gtp_remat_size"], cfg["expert_gtp_remat_size"] = gtp, egtp
    if release.before("0.14"):  # the encoder/decoder era
        if rng.random() < 0.6:
            enc_pp, enc_tp = rng.choice([1, 1, 2, None]), rng.choice([0, 1, tp, tp])
            cfg["encoder_pipeline_model_parallel_size"], cfg["encoder_tensor_model_parallel_size"] = enc_pp, enc_tp
            cfg["world_size"] += (enc_tp or tp) * (enc_pp or 0) * cp * dp
        if rng.random() < 0.3:
            cfg["pipeline_model_parallel_split_rank"] = rng.choice([0, 1, 2, -1])
    if rng.random() < 0.1:  # now and then an invalid world size
        cfg["world_size"] += 1 if "local_world_size" not in cfg else 0
        if "local_world_size" in cfg:
            cfg["local_world_size"] += 1
            cfg["world_size"] += 1
    return cfg


def configs_for(series: str, seed: int = 10) -> list[dict]:
    """The seeded configurations checked on ``series``: a few large worlds (up to ~1,024)."""
    rng = random.Random(f"{seed}-{series}")
    out = [_draw(rng, series, big=i < 3) for i in range(CONFIGS_PER_RELEASE)]
    out.append({"world_size": 8, "order": "tp-cp-ep-dp-pp"})  # every default
    big = {
        "world_size": 1024,
        "tensor_model_parallel_size": 4,
        "pipeline_model_parallel_size": 4,
        "context_parallel_size": 2,
        "expert_model_parallel_size": 8,
        "expert_tensor_parallel_size": 2,
        "order": "tp-cp-ep-dp-pp",
        "num_distributed_optimizer_instances": 2,
    }
    if parse_release(series).at_least("0.17"):
        big.update(rank_offset=8, local_world_size=1024, world_size=1032)
    if parse_release(series).at_least("0.19"):
        big.update(num_distributed_optimizer_instances=1, gtp_remat_size=2, expert_gtp_remat_size=2)
    out.append(big)
    if parse_release(series).before("0.14"):
        enc = {"encoder_tensor_model_parallel_size": 1, "encoder_pipeline_model_parallel_size": 1}
        # MCore's own example (6 ranks, tp-dp-pp), with expert tp 1: the distributed-optimizer
        # instance groups (0.13) then take encoder and decoder tp-ep-pp groups together.
        out.append({"world_size": 6, "order": "tp-dp-pp", "tensor_model_parallel_size": 2, **enc})
        out.append(
            {
                "world_size": 6,
                "order": "tp-dp-pp",
                "tensor_model_parallel_size": 2,
                "expert_tensor_parallel_size": 1,
                **enc,
            }
        )
        # decoder tp not a multiple of the encoder's: uneven stitching of pipelines
        out.append(
            {
                "world_size": 20,
                "tensor_model_parallel_size": 3,
                "pipeline_model_parallel_size": 2,
                "encoder_tensor_model_parallel_size": 2,
                "encoder_pipeline_model_parallel_size": 2,
            }
        )
        out.append(
            {
                "world_size": 40,
                "tensor_model_parallel_size": 4,
                "pipeline_model_parallel_size": 2,
                "context_parallel_size": 2,
                "encoder_tensor_model_parallel_size": 2,
                "encoder_pipeline_model_parallel_size": 1,
                "expert_model_parallel_size": 2,
                "hierarchical_context_parallel_sizes": [2, 1],
                "pipeline_model_parallel_split_rank": 1,
            }
        )
        out.append(
            {
                "world_size": 20,
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
                "num_distributed_optimizer_instances": 2,
                **enc,
            }
        )
        out.append(
            {
                "world_size": 8,
                "tensor_model_parallel_size": 1,
                "encoder_tensor_model_parallel_size": 2,
                "encoder_pipeline_model_parallel_size": 1,
            }
        )  # encoder tp > tp: AssertionError
        out.append({"world_size": 16, "context_parallel_size": 4, "hierarchical_context_parallel_sizes": [3]})
    if parse_release(series).at_least("0.19"):
        # 0.19 quirks: an order without "tp" (ValueError / AssertionError), an upper-case order
        # (GTP axis injected first; rejected by the order.endswith("pp") check unless pp == 1 or
        # the data-parallel sizes agree), GTP with two optimizer instances (AssertionError).
        out.append({"world_size": 8, "order": "cp-ep-dp-pp", "pipeline_model_parallel_size": 2})
        out.append({"world_size": 16, "order": "cp-ep-dp-pp", "tensor_model_parallel_size": 2})
        out.append(
            {
                "world_size": 16,
                "order": "TP-CP-EP-DP-PP",
                "tensor_model_parallel_size": 2,
                "gtp_remat_size": 2,
                "expert_model_parallel_size": 2,
                "expert_gtp_remat_size": 2,
            }
        )
        out.append({"world_size": 16, "gtp_remat_size": 2, "num_distributed_optimizer_instances": 2})
        # gtp_remat placed by the user: kept where it is in both generators.
        out.append(
            {
                "world_size": 32,
                "order": "gtp_remat-tp-cp-ep-dp-pp",
                "tensor_model_parallel_size": 2,
                "gtp_remat_size": 2,
                "expert_model_parallel_size": 2,
                "expert_gtp_remat_size": 2,
                "pipeline_model_parallel_size": 2,
            }
        )
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
# The installed release and 0.19 in every run, the others in turn (docs/testing.md, "Rotating parts").
@pytest.mark.parametrize("series", rotation.sample(list(RELEASES), keep={INSTALLED_SERIES, "0.19"}, parts=3))
def test_layout_matches_release(series: str) -> None:
    configs = configs_for(series)
    assert max(c.get("local_world_size") or c["world_size"] for c in configs) >= 1024
    result = run_in_release(
        RELEASES[series], "tests.support.releases.layout_checks", "check_release", series, configs, 10
    )
    stats = result["stats"]
    assert result["mismatch_count"] == 0, "\n".join(result["mismatches"])
    # Every configuration was either compared or rejected by both sides; most are compared.
    assert stats["configs"] + stats["rejected"] == len(configs)
    assert stats["configs"] >= len(configs) // 2
    assert stats["groups"] > 0 and stats["rank_checks"] > 0 and stats["generator_checks"] > 0
    assert stats["plan_steps"] > 0  # the group plan was compared step by step with the release


def test_release_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="rank_offset"):
        MegatronLayout(world_size=8, rank_offset=2, release="0.16")
    with pytest.raises(TypeError, match="gtp_remat_size"):
        MegatronLayout(world_size=8, gtp_remat_size=2, release="0.18")
    with pytest.raises(ValueError, match="exceeds world_size"):
        MegatronLayout(world_size=8, rank_offset=4, local_world_size=8, release="0.17")
    with pytest.raises(ValueError, match="supported series"):
        MegatronLayout(world_size=8, release="0.11")


def test_gtp_sizes_one_equal_018() -> None:
    rng = random.Random(3)
    for _ in range(20):
        cfg = _draw(rng, "0.18", big=False)
        cfg.pop("hybrid_context_parallel", None)
        try:
            old = MegatronLayout(release="0.18", **cfg)
        except (RuntimeError, AssertionError, ValueError, KeyError):
            continue
        new = MegatronLayout(release="0.19", gtp_remat_size=1, expert_gtp_remat_size=1, **cfg)
        for kind in old.kinds():
            assert new.enumerate(kind) == old.enumerate(kind), kind
        assert set(new.kinds()) - set(old.kinds()) == {"gtp_remat", "expt_gtp_remat", "tp_ep_gtp_remat_pp"}


def test_layout_tool_release_and_gtp(capsys) -> None:
    from parallel_state_ng.__main__ import main

    args = [
        "layout",
        "--world-size",
        "32",
        "--tp",
        "2",
        "--pp",
        "2",
        "--ep",
        "2",
        "--gtp-remat-size",
        "2",
        "--expert-gtp-remat-size",
        "2",
        "--release",
        "0.19",
        "--format",
        "json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    lay = MegatronLayout(
        world_size=32,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        gtp_remat_size=2,
        expert_gtp_remat_size=2,
        release="0.19",
    )
    assert list(report["kinds"]) == lay.kinds()
    assert (
        report["kinds"]["gtp_remat"]["groups"]
        == lay.enumerate("gtp_remat")
        == [[r, r + 2] for base in range(0, 32, 4) for r in (base, base + 1)]
    )
    assert report["report"]["config"]["expert_dims"] == {"etp": 2, "ep": 2, "egtp_remat": 2, "edp": 2, "pp": 2}
    assert main(["layout", "--world-size", "32", "--gtp-remat-size", "2", "--release", "0.18"]) == 2
    assert "--gtp-remat-size" in capsys.readouterr().err
