"""Megatron GPT training under ``PSNG_SHARE_GROUPS=safe``: bit-identical to unshared compat and to MCore.

The core example (``scripts/examples/gpt/training.py``) on a 4-rank gloo world, per release from
its unzipped wheel, in fresh processes of its own: compat installed after megatron's import
without sharing, the same under ``PSNG_SHARE_GROUPS=safe`` (the environment variable, read by
compat's ``initialize_model_parallel``), and MCore's own parallel_state. Losses, gradient norms
and every rank's final parameters must be equal, and ``safe`` must really have shared (``dp`` is
``dp_cp``) while keeping apart what it must (``ep`` equal in members to ``dp_cp`` but its own
group; the all-gather twins their own groups).

Layouts: dense tp 2 dp 2 with ``overlap_grad_reduce`` (and the distributed optimizer with
``overlap_param_gather`` from 0.13 on: 0.12's distributed optimizer asks for TransformerEngine
on CPU); MoE tp 1 pp 2 dp 2 ep 2 (all-to-all dispatcher; there ``ep`` has the members of ``dp``
and ``dp_cp``) with the distributed optimizer and both overlaps from 0.16 on (0.12-0.14: the
example's model config is refused, "Bias is not supported for MoE"; 0.15: MCore's own MoE run is
not bit-reproducible from run to run on CPU). The all-gather twins where the release has them
(0.16+), made as ``megatron.training`` makes them; Megatron's DDP does not use them (Megatron
FSDP does, and needs CUDA). One release a run (rotating, 8 parts: tests/support/rotation.py).
"""

from __future__ import annotations

import math

import pytest

from scripts.examples.gpt.config import TrainConfig
from tests.support import rotation
from tests.support.releases.wheels import RELEASES, release_dir

VARIANTS = ("compat-after", "compat-safe", "mcore")
ALL = list(RELEASES.values())
TODAY = rotation.sample(ALL, keep=(), parts=len(ALL))


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def sharing_layouts(version: str) -> list[TrainConfig]:
    """The layouts trained on ``version`` (see the module docstring for what each release runs)."""
    v = _version(version)
    base = TrainConfig(steps=3, megatron_path=str(release_dir(version)), all_gather_group=v >= (0, 16))
    out = [base.replace(tp=2, dp=2, dist_opt=v >= (0, 13), overlap=True)]
    if v >= (0, 16):
        out.append(base.replace(pp=2, dp=2, ep=2, experts=4, dist_opt=True, overlap=True))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("version", TODAY)
def test_safe_sharing_trains_bit_identically(version):
    cfgs = sharing_layouts(version)
    results = _train(4, cfgs)
    _check_bit_identical(version, cfgs, results)
    for i, cfg in enumerate(cfgs):
        for by_variant in results:
            reference = by_variant["mcore"][i]
            safe, unshared = by_variant["compat-safe"][i]["groups"], by_variant["compat-after"][i]["groups"]
            assert safe["dp is dp_cp"] and safe["tp is tp_cp"]  # safe shared (cp = 1)
            assert not unshared["dp is dp_cp"] and not reference["groups"]["dp is dp_cp"]
            assert not safe["ep is dp_cp"]  # the MoE layout: equal members, kept apart
            assert not safe.get("dp_cp_ag is dp_cp") and not safe.get("expt_dp_ag is expt_dp")
            if cfg.all_gather_group:
                assert "dp_cp_ag is dp_cp" in safe
        losses = next(r["mcore"][i]["losses"] for r in reversed(results) if r["mcore"][i]["losses"])
        assert len(losses) == cfg.steps and all(math.isfinite(x) for x in losses)


def _train(size: int, cfgs: list[TrainConfig]) -> list[dict]:
    """Every variant of :data:`VARIANTS` on a fresh gloo world of ``size`` ranks; results by rank."""
    from parallel_state_ng.testing.worlds import GlooWorld
    from scripts.examples.gpt import training as gpt_training

    world = GlooWorld(size)
    try:
        return world.run(gpt_training.train_variants, cfgs, VARIANTS, timeout=600)
    finally:
        world.close()


def corner_layouts(version: str) -> list[TrainConfig]:
    """The size-1 corners where a merge could reach an audited use (docs/compat.md, "Identity audit").

    On 2 ranks: MoE at tp = pp = ep = 1 with the standard optimizer (mp and tp_ep_pp are size-1
    groups: ChainedOptimizer compares them with ==), and the distributed optimizer at dp x cp = 1
    (pp 2: mp, the optimizer instance group and tp_ep_pp have the same members). MoE from 0.16 on (see the module
    docstring); before, the dense corner (tp = pp = 1, standard optimizer) instead.
    """
    base = TrainConfig(steps=3, megatron_path=str(release_dir(version)))
    if _version(version) >= (0, 16):
        moe = base.replace(experts=2, bias=False)  # bias: see TrainConfig.bias
        return [moe.replace(dp=2), moe.replace(pp=2, dist_opt=True)]
    return [base.replace(dp=2), base.replace(tp=2, dist_opt=_version(version) >= (0, 13))]


def _check_bit_identical(version: str, cfgs: list[TrainConfig], results: list[dict]) -> None:
    """Unshared compat and ``safe`` equal MCore on every rank, and ``safe`` kept the grad-statistics tie."""
    for i, cfg in enumerate(cfgs):
        for rank, by_variant in enumerate(results):
            reference = by_variant["mcore"][i]
            assert reference["facts"]["version"] == version
            for variant in ("compat-after", "compat-safe"):
                run = by_variant[variant][i]
                assert run["facts"]["schedules.parallel_state"] == "compat.parallel_state", variant
                assert run["leaked_groups"] == 0, (variant, rank)
                for key in ("losses", "grad_norms", "digest", "params"):
                    assert run[key] == reference[key], f"{version} {cfg.label()} rank {rank}: {variant} {key}"
            safe, unshared = by_variant["compat-safe"][i]["groups"], by_variant["compat-after"][i]["groups"]
            for key in ("mp is tp_ep_pp", "mp is intra_dist_opt"):  # the grad-statistics tie
                assert safe.get(key) == unshared.get(key) == reference["groups"].get(key), (cfg.label(), key)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("version", TODAY)
def test_safe_sharing_at_the_size_one_corners(version):
    cfgs = corner_layouts(version)
    results = _train(2, cfgs)
    _check_bit_identical(version, cfgs, results)
    single = [TrainConfig(steps=3, megatron_path=str(release_dir(version)))]  # a single rank
    if _version(version) >= (0, 16):
        single = [single[0].replace(experts=2, bias=False)]
    results = _train(1, single)
    _check_bit_identical(version, single, results)
