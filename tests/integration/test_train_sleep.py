"""Megatron GPT training with every communicator asleep and awake again after each step (issue 51).

The core example (``scripts/examples/gpt/training.py``) on 4 gloo ranks, under compat installed
after megatron's import: each layout trained without the interlude, then with
``compat.parallel_state.sleep_model_parallel()``, a refused collective on the sleeping data-parallel
group and ``wake_model_parallel()`` after each of 5 optimizer steps (5 cycles); and under MCore.
Losses, gradient norms and every rank's final parameters must be bit-identical. Layouts: dense
tp 2 dp 2 with the distributed optimizer and both overlaps; MoE pp 2 dp 2 ep 2 (all-to-all) with
the distributed optimizer and both overlaps. On gloo the groups are fenced (torch 2.13 cannot
release a gloo communicator behind its handle): this proves the handles, the numbers and the
refusal, not freed memory (docs/compat.md, "Sleep and wake").
"""

from __future__ import annotations

import importlib.util

import pytest

from scripts.examples.gpt.config import TrainConfig

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

LAYOUTS = [
    TrainConfig(steps=5, tp=2, dp=2, dist_opt=True, overlap=True),
    TrainConfig(steps=5, pp=2, dp=2, ep=2, experts=4, dist_opt=True, overlap=True),
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.rotating(1, 10)  # end-to-end part 2 of 10 (docs/testing.md, "Rotating parts")
def test_training_with_sleep_and_wake_after_every_step_is_bit_identical():
    from parallel_state_ng.testing.worlds import GlooWorld
    from scripts.examples.gpt import training as gpt_training

    world = GlooWorld(4)
    try:
        plain = world.run(gpt_training.train_variants, LAYOUTS, ("compat-after", "mcore"), timeout=600)
        slept = world.run(
            gpt_training.train_variants, [c.replace(sleep_wake=True) for c in LAYOUTS], ("compat-after",), timeout=600
        )
    finally:
        world.close()
    for i, cfg in enumerate(LAYOUTS):
        for rank in range(4):
            reference, unslept = plain[rank]["mcore"][i], plain[rank]["compat-after"][i]
            run = slept[rank]["compat-after"][i]
            assert run["leaked_groups"] == 0, (cfg.label(), rank)
            for key in ("losses", "grad_norms", "digest", "params"):
                assert run[key] == unslept[key] == reference[key], f"{cfg.label()} rank {rank}: {key}"
        assert len(next(r["compat-after"][i]["losses"] for r in slept if r["compat-after"][i]["losses"])) == 5
