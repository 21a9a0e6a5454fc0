"""A real Megatron-Core GPT training run on CPU processes (gloo), under compat and under MCore.

``scripts/examples/gpt/training.py`` runs Megatron's own loop: ``GPTModel`` (local layer spec),
``get_forward_backward_func()`` (1F1B, interleaved), ``DistributedDataParallel`` +
``finalize_model_grads``, ``get_megatron_optimizer`` (Adam, clipping, distributed optimizer),
MoE with the all-to-all dispatcher, dropout through the tensor-parallel RNG tracker.

* Every layout is trained in the same fresh worker processes with compat installed BEFORE
  megatron is first imported and with MCore's own parallel_state (after ``compat.uninstall()``);
  the 4-rank layouts and the first 8-rank one also with compat installed AFTER the import. Losses, gradient norms and every rank's parameter digest
  must be bit-identical; under compat megatron's code must really have resolved to compat, and
  ``destroy_model_parallel`` must leave no process group behind.
* Correctness without MCore: weights set from their global names, the same global batch;
  tp 1 pp 1 (the script itself, one process) and several 4-rank layouts give the same
  first-step loss and gradient norm to float tolerance.
* The script's option errors come before any process starts.

Fresh worlds (not the shared ``gloo_world``) for the first point: "before" needs workers that
never imported megatron.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from scripts.examples.gpt.config import TrainConfig, TrainOptionError, validate
from tests.support.paths import ROOT

if importlib.util.find_spec("megatron") is None:  # without importing it in the test process
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from scripts.examples import train_gpt  # noqa: E402
from scripts.examples.gpt import model as gpt_model  # noqa: E402
from scripts.examples.gpt import training as gpt_training  # noqa: E402

FOUR_RANKS = [TrainConfig(tp=2, pp=2), TrainConfig(tp=2, pp=2, dropout=0.1)]
EIGHT_RANKS_DENSE = [
    TrainConfig(tp=2, pp=2, dp=2),
    TrainConfig(tp=2, pp=2, dp=2, vpp=2),
    TrainConfig(tp=2, pp=2, dp=2, dist_opt=True),
]
EIGHT_RANKS_MOE = [
    TrainConfig(tp=1, pp=2, dp=4, ep=2, experts=4, dispatcher="alltoall"),
    TrainConfig(tp=1, pp=2, dp=4, ep=2, experts=4, dispatcher="allgather"),
]
VARIANTS = tuple(gpt_training.VARIANTS)


def _check_variants(results: list[dict], cfgs: list[TrainConfig]) -> dict[str, list[float]]:
    """Every variant equal to MCore, rank by rank; returns the losses per layout."""
    losses = {}
    for i, cfg in enumerate(cfgs):
        label = cfg.label()
        for rank, by_variant in enumerate(results):
            reference = by_variant["mcore"][i]
            assert reference["facts"]["schedules.parallel_state"] == "megatron.core.parallel_state"
            for variant in ("compat-before", "compat-after"):
                if i >= len(by_variant.get(variant, [])):  # a variant run on the first layouts only, or not
                    continue
                run = by_variant[variant][i]
                facts = {k: v for k, v in run["facts"].items() if k != "version"}
                assert set(facts.values()) == {"compat.parallel_state", "True"}, (variant, run["facts"])
                assert run["leaked_groups"] == 0, (variant, label, rank, run["leaked_groups"])
                for key in ("losses", "grad_norms", "digest", "params"):
                    assert run[key] == reference[key], f"{label}, rank {rank}: {variant} {key} differs from MCore"
        last = [by_variant["mcore"][i]["losses"] for by_variant in results]
        reported = [x for x in last if x is not None]
        assert len(reported) == cfg.world_size // cfg.pp and all(x == reported[0] for x in reported), label
        assert len(reported[0]) == cfg.steps
        assert all(math.isfinite(x) and 0 < x < 2 * math.log(cfg.vocab) for x in reported[0]), reported[0]
        losses[label] = reported[0]
    # Layouts and dropout really trained different things; the two MoE dispatchers compute the
    # same numbers (a check of the allgather path against the alltoall one).
    by_model: dict[TrainConfig, set] = {}
    for i, cfg in enumerate(cfgs):
        digests = tuple(r["mcore"][i]["digest"] for r in results)
        by_model.setdefault(cfg.replace(dispatcher="alltoall"), set()).add(digests)
    assert all(len(d) == 1 for d in by_model.values()), "alltoall and allgather dispatchers differ"
    assert len({d for ds in by_model.values() for d in ds}) == len(by_model)
    return losses


def _run_fresh(
    world_size: int, cfgs: list[TrainConfig], timeout: float, first_only: tuple = (), variants: tuple = VARIANTS
) -> list[dict]:
    from parallel_state_ng.testing.worlds import GlooWorld

    world = GlooWorld(world_size)
    try:
        return world.run(gpt_training.train_variants, cfgs, variants, first_only, timeout=timeout)
    finally:
        world.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_ranks_compat_trains_exactly_like_mcore():
    results = _run_fresh(4, FOUR_RANKS, timeout=600)
    losses = _check_variants(results, FOUR_RANKS)
    # dropout changes the numbers (the RNG tracker forks per tp rank)
    assert losses["tp2 pp2 dp1"] != losses["tp2 pp2 dp1 dropout0.1"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "moe",
    [  # end-to-end parts 2 and 4 of 10 (docs/testing.md, "Rotating parts")
        pytest.param(False, id="dense", marks=pytest.mark.rotating(1, 10)),
        pytest.param(True, id="moe", marks=pytest.mark.rotating(3, 10)),
    ],
)
def test_eight_ranks_compat_trains_exactly_like_mcore(moe):
    # compat installed after megatron's import: on the first dense layout here (and on both
    # 4-rank ones); the two MoE dispatchers train in one world, where their numbers must agree
    if moe:
        results = _run_fresh(8, EIGHT_RANKS_MOE, timeout=900, variants=("compat-before", "mcore"))
    else:
        results = _run_fresh(8, EIGHT_RANKS_DENSE, timeout=900, first_only=("compat-after",))
    _check_variants(results, EIGHT_RANKS_MOE if moe else EIGHT_RANKS_DENSE)


def _script(*options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "scripts.examples", "train_gpt", *options],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.slow
@pytest.mark.rotating(8, 10)  # end-to-end part 9 of 10 (docs/testing.md, "Rotating parts")
def test_layouts_agree_on_the_same_global_model(gloo_world):
    """Same global weights and batch (8 microbatches of 2): the first step's loss and gradient
    norm do not depend on the layout. tp 1 pp 1 runs through the script, the rest on 4 ranks.
    """
    single = _script(
        "--impl", "compat", "--tp", "1", "--pp", "1", "--microbatches", "8", "--steps", "1", "--init-from-names"
    )
    assert single.returncode == 0, single.stderr[-3000:]
    match = re.search(r"^losses: \[(.*)\]$", single.stdout, re.M)
    assert match and re.search(r"^step 1: loss ", single.stdout, re.M), single.stdout
    reference = float(match.group(1))
    assert 0 < reference < 2 * math.log(128)

    base = TrainConfig(steps=1, init_from_names=True)
    layouts = [
        base.replace(tp=1, pp=1, dp=4, microbatches=2),
        base.replace(tp=2, pp=2, dp=1, microbatches=8),
        base.replace(tp=2, pp=1, dp=2, microbatches=4),
        base.replace(tp=1, pp=2, dp=2, microbatches=4),
        base.replace(tp=2, pp=2, dp=1, vpp=2, microbatches=8),
    ]
    results = gloo_world(4).run(gpt_training.train_variants, layouts, ("compat-after",), timeout=600)
    for i, cfg in enumerate(layouts):
        runs = [r["compat-after"][i] for r in results]
        loss = next(r["losses"] for r in runs if r["losses"] is not None)[0]
        assert loss == pytest.approx(reference, rel=2e-5), cfg.label()
        norms = {r["grad_norms"][0] for r in runs}
        assert len(norms) == 1, (cfg.label(), norms)  # clip_grads' norm is global
        if i == 0:
            first_norm = norms.pop()
        else:
            assert norms.pop() == pytest.approx(first_norm, rel=1e-4), cfg.label()


@pytest.mark.parametrize(
    "options, message",
    [
        (["--tp", "2", "--pp", "2", "--world-size", "6"], "not divisible by tp * pp = 4"),
        (["--tp", "2", "--pp", "1", "--vpp", "2"], "--vpp needs --pp > 1"),
        (["--tp", "3", "--pp", "1"], "--heads 4 is not divisible by --tp 3"),
        (["--pp", "3"], "--num-layers 4 is not divisible by pp * vpp = 3"),
        (["--tp", "2", "--pp", "1", "--dp", "2", "--ep", "2", "--experts", "4"], "--experts needs --tp 1"),
        (["--tp", "1", "--pp", "1", "--dp", "4", "--ep", "3", "--experts", "6"], "--ep 3 does not divide"),
        (["--tp", "1", "--pp", "1", "--ep", "2"], "--ep > 1 needs --experts"),
        (["--tp", "1", "--pp", "2", "--vpp", "2", "--microbatches", "3"], "must be a multiple of --pp 2"),
        (["--tp", "0"], "--tp must be an integer >= 1"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    ],
)
def test_bad_options_fail_before_any_process(options, message, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(train_gpt, "launch", lambda cfg, **kw: started.append(cfg))
    assert train_gpt.main(options) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: invalid training options"), err
    assert not started


def test_validate_accepts_the_tested_layouts():
    for cfg in FOUR_RANKS + EIGHT_RANKS_DENSE + EIGHT_RANKS_MOE:
        assert validate(cfg) is cfg
    with pytest.raises(TrainOptionError, match="--impl must be one of"):
        validate(TrainConfig(impl="megatron"))


def test_global_names_of_a_pipeline_stage():
    """Local layer / expert indices map to the unsplit model's names."""

    class Layer:
        def __init__(self, number):
            self.layer_number = number

    class Chunk:
        share_embeddings_and_output_weights = True

        class decoder:
            layers = [Layer(3), Layer(4)]

    chunk = Chunk()
    name = gpt_model.global_param_name
    assert name(chunk, "decoder.layers.1.mlp.linear_fc1.weight") == "decoder.layers.3.mlp.linear_fc1.weight"
    assert (
        name(chunk, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", num_local_experts=2, ep_rank=1)
        == "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    assert name(chunk, "output_layer.weight") == "embedding.word_embeddings.weight"
    assert name(chunk, "decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
