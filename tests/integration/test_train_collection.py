"""Training from a ProcessGroupCollection (no ``initialize_model_parallel``) equals the global path.

The tiny GPT of ``scripts/examples/gpt/training.py`` is built, wrapped, optimised and scheduled with the
collection of :func:`parallel_state_ng.build_megatron_groups` passed as ``pg_collection=``
(``scripts/examples/gpt/collection.py``: ``ensure_global_memory_buffer``, ``megatron_schedule``), and
again through MCore's own globals, in the same gloo processes, on megatron-core 0.19.2's wheel
(before 0.19 the GPT loss reads the global tensor-parallel group: refused with a clear error); and
on 0.18.2 with compat serving the collection as the globals (``compat.use_collection``, tp2 pp2
only: the other releases and layouts are in docs/results/training.md). Losses, gradient norms and every rank's parameter digest
must be bit-identical, with no leaked group, and Megatron's globals must stay uninitialized
throughout the collection run.
"""

from __future__ import annotations

import importlib.util

import pytest

from scripts.examples.gpt.config import TrainConfig, TrainOptionError, validate

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from scripts.examples.gpt import collection as gpt_collection  # noqa: E402
from scripts.examples.gpt import training as gpt_training  # noqa: E402
from tests.support.releases import wheels as mcore_releases  # noqa: E402

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
            assert ours["leaked_groups"] == 0, (cfg.label(), rank)  # MCore's own destroy leaks (~20 per rank)
            for key in ("losses", "grad_norms", "digest", "params"):
                assert ours[key] == reference[key], f"{cfg.label()} rank {rank}: {key} differs from the global path"
        assert any(r["collection"][i]["losses"] for r in results[: cfg.world_size])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize(
    "world",
    [  # end-to-end parts 7 and 1 of 10 (docs/testing.md, "Rotating parts")
        pytest.param(4, marks=pytest.mark.rotating(6, 10)),
        pytest.param(8, marks=pytest.mark.rotating(0, 10)),
    ],
)
def test_collection_trains_exactly_like_the_global_path(world):
    from parallel_state_ng.testing.worlds import GlooWorld

    path = str(mcore_releases.release_dir(mcore_releases.RELEASES["0.19"]))
    cfgs = [cfg.replace(megatron_path=path) for cfg in LAYOUTS if cfg.world_size == world]
    gloo = GlooWorld(world)
    try:
        results = gloo.run(gpt_training.train_collection_and_globals, cfgs, timeout=900)
    finally:
        gloo.close()
    _compare(results, cfgs)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.rotating(7, 10)  # end-to-end part 8 of 10 (docs/testing.md, "Rotating parts")
def test_collection_served_by_compat_trains_like_the_global_path_on_0_18():
    """0.18's GPT loss reads the global tensor-parallel group: ``compat.use_collection`` serves it."""
    from parallel_state_ng.testing.worlds import GlooWorld

    path = str(mcore_releases.release_dir(mcore_releases.RELEASES["0.18"]))
    cfgs = [LAYOUTS[0].replace(megatron_path=path)]
    gloo = GlooWorld(4)
    try:
        results = gloo.run(gpt_training.train_collection_and_globals, cfgs, served=True, timeout=900)
    finally:
        gloo.close()
    _compare(results, cfgs)
    assert all(r["collection"][0]["facts"]["served as globals"] == "True" for r in results)


def test_group_sources_are_checked():
    validate(TrainConfig(tp=2, pp=2, impl="compat", groups="collection"))  # served by compat.use_collection
    with pytest.raises(TrainOptionError, match="--groups must be one of globals, collection"):
        validate(TrainConfig(groups="mpu"))


def test_releases_before_019_are_refused(monkeypatch):
    from parallel_state_ng.releases import parse_release

    monkeypatch.setattr("parallel_state_ng.releases.current_release", lambda: parse_release("0.18.2"))
    with pytest.raises(
        RuntimeError, match="needs megatron-core 0.19\\+ \\(got 0.18.2\\).*vocab_parallel_cross_entropy"
    ):
        gpt_collection.train_collection(TrainConfig(tp=2, pp=2, groups="collection"))
