"""Training from a ProcessGroupCollection (no ``initialize_model_parallel``) equals the global path.

The tiny GPT of ``scripts/gpt_training.py`` is built, wrapped, optimised and scheduled with the
collection of :func:`parallel_state_ng.build_megatron_groups` passed as ``pg_collection=``
(``scripts/gpt_collection.py``), and again through MCore's own globals, in the same gloo
processes (installed megatron-core). Losses, gradient norms and every rank's parameter digest
must be bit-identical, with no leaked group, and Megatron's globals must stay uninitialized
throughout the collection run.
"""

from __future__ import annotations

import importlib.util

import pytest
from gpt_config import TrainConfig, TrainOptionError, validate  # scripts/ (pythonpath in pyproject.toml)

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

import gpt_training  # noqa: E402

LAYOUTS = [
    TrainConfig(tp=2, pp=2, steps=2),
    TrainConfig(tp=2, pp=2, dp=2, dist_opt=True, steps=2),
    TrainConfig(tp=2, pp=2, dp=2, vpp=2, steps=2),
    TrainConfig(tp=1, pp=2, dp=4, ep=2, experts=4, steps=2),
]


def _compare(results: list[dict], cfgs: list[TrainConfig]) -> None:
    for i, cfg in enumerate(cfgs):
        for rank, by_path in enumerate(results[: cfg.world_size]):
            ours, reference = by_path["collection"][i], by_path["globals"][i]
            assert ours["facts"]["globals initialized"] == "False", (cfg.label(), rank)
            assert ours["leaked_groups"] == 0 and reference["leaked_groups"] == 0
            for key in ("losses", "grad_norms", "digest", "params"):
                assert ours[key] == reference[key], f"{cfg.label()} rank {rank}: {key} differs from the global path"
        assert any(r["collection"][i]["losses"] for r in results[: cfg.world_size])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [4, 8])
def test_collection_trains_exactly_like_the_global_path(world):
    from tests.support.gloo_world import GlooWorld

    cfgs = [cfg for cfg in LAYOUTS if cfg.world_size == world]
    gloo = GlooWorld(world)
    try:
        results = gloo.run(gpt_training.train_collection_and_globals, cfgs, timeout=900)
    finally:
        gloo.close()
    _compare(results, cfgs)


def test_collection_needs_mcore_impl():
    with pytest.raises(TrainOptionError, match="--groups collection .* --impl mcore"):
        validate(TrainConfig(tp=2, pp=2, impl="compat", groups="collection"))
    with pytest.raises(TrainOptionError, match="--groups must be one of globals, collection"):
        validate(TrainConfig(groups="mpu"))
