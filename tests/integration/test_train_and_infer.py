"""Training and inference layouts in one job (``scripts/examples/train_and_infer.py``), and its failures.

The slow test runs the script's ranks on 4 gloo processes with megatron-core 0.19.2's wheel:
train tp2 pp2 for 2 steps from ``build_megatron_groups``, build the colocated tp4 pp1 inference
layout with ``build_inference_collection`` (with the training's timeout), move the weights,
compare the logits with a one-rank model's, destroy the inference layout, take step 3; step 3
(loss, gradient norm, every rank's digest) must equal the same run without the inference phase.
The run with the inference phase has the process-wide registry on (the reference run sharing
off, so the cost is that of the registry-less test): the inference layout creates no
communicator of its own and, once destroyed, leaves the registry holding exactly the training
layout's groups; the communicator counts are measured under the three sharing settings. Once
the weights are gathered, the training groups the inference layout does not borrow sleep until it
is destroyed (issue 51: refused while asleep, step 3 still bit-identical), and 5 sleep/wake
cycles of the training layout follow, counted for leaks (threads, sockets, descriptors, groups;
the 50-cycle count: tests/groups/test_sleep_gloo.py and the example's default). (The 8-process tp2 pp2 dp2 run
and its figures are in docs/results/training.md.) The other tests are cheap: bad inference layouts,
building twice, destroying twice, using a destroyed collection.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.groups.torch_support import torch_has
from scripts.examples import train_and_infer
from scripts.examples.gpt.config import TrainConfig, TrainOptionError

TRAINING = TrainConfig(tp=2, pp=2, dp=2, steps=3)
SIZES = {"pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.rotating(5, 10)  # end-to-end part 6 of 10 (docs/testing.md, "Rotating parts")
def test_inference_between_steps_leaves_training_bit_identical():
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    from parallel_state_ng.testing.worlds import GlooWorld
    from scripts.examples.gpt import colocated
    from tests.support.releases import wheels as mcore_releases

    path = str(mcore_releases.release_dir(mcore_releases.RELEASES["0.19"]))
    cfg = TrainConfig(tp=2, pp=2, dp=1, steps=3, megatron_path=path)
    with GlooWorld(cfg.world_size, timeout=600, env={"PYTHONWARNINGS": "ignore"}) as world:
        results = world.run(colocated.train_and_infer_rank, cfg, 4, 5)
    summary = train_and_infer.summarize(results)
    assert summary["identical"], "step 3 differs after the inference phase"
    assert len(summary["losses"]["with_inference"]) == 3 and not summary["globals initialized"]
    assert 0 <= summary["max abs diff"] <= colocated.LOGITS_TOLERANCE
    for rank, entry in enumerate(summary["inference"]):
        assert entry["inference ranks"]["tp"] == [0, 1, 2, 3], rank
        assert entry["logits shape"] == [cfg.micro_batch, cfg.seq, cfg.vocab], rank
        assert entry["params moved"] == entry["full params"] > 0, rank
    assert summary["registry after destroy"], "the registry does not hold exactly the training groups"
    for rank, counts in enumerate(summary["communicators"]):
        off, build, registry = counts["off"], counts["per build (1)"], counts["process-wide registry"]
        assert off["both"] == off["training"] + off["inference"], rank  # two builds never share
        assert build["both"] == build["training"] + build["inference"] < off["both"], rank
        assert registry["training"] == build["training"], rank  # within one build: as with 1
        # every inference group's members are a training group's, in the same order, on 4 ranks
        # (tp2 pp2: the world group is the training mp group [0, 1, 2, 3])
        assert registry["inference"] == 0 and registry["both"] == registry["training"], rank
        assert registry["inference shared"] == registry["inference distinct"] > 0, rank
        assert registry["after destroy"]["exactly training"], rank
    for rank, entry in enumerate(summary["inference"]):
        assert entry["after destroy"]["registry holds"] == entry["after destroy"]["training groups"] > 0, rank
    sleep = summary["sleep"]
    assert sleep["refused"] and sleep["asleep holds no more"] and sleep["no growth"], sleep
    for rank, phase in enumerate(sleep["phases"]):
        # tp2 pp2 on 4 ranks under the registry: the tp and pp groups sleep, the world-sized and
        # one-rank groups that the inference layouts borrow stay awake
        assert phase["slept groups"] == 2 and phase["lent awake"] == 2, (rank, phase)
        assert phase["mechanisms"] == {"fenced": 2}, (rank, phase)
    assert [c["cycles"] for c in sleep["cycles"]] == [5] * 4
    report = train_and_infer.render(cfg, 4, summary, colocated.LOGITS_TOLERANCE)
    assert any(line.startswith("5 sleep/wake cycles of the whole training layout") and ": none;" in line
               for line in report)  # fmt: skip
    assert "step 3 bit-identical with and without the inference phase: True" in report
    assert any("holds exactly the training layout's groups, all alive: True (rank 0: " in line for line in report)


def test_an_inference_layout_that_does_not_fit_is_refused(fake_world):
    pytest.importorskip("megatron.core.process_groups_config")
    from parallel_state_ng.builders.inference import build_inference_collection

    fake_world(0, 8)
    with pytest.raises(RuntimeError, match=r"window .* = \[0, 16\) does not fit in the 8 ranks"):
        build_inference_collection(16, tp_size=4, **SIZES)
    with pytest.raises(TrainOptionError, match="--infer-tp 3 does not divide the world of tp\\*pp\\*dp = 8 ranks"):
        train_and_infer.check_inference_layout(TRAINING, 3)


def test_a_tp_that_does_not_divide_the_heads_is_refused_before_any_process(capsys):
    with pytest.raises(TrainOptionError, match="--infer-tp 8 does not divide the model's --heads 4"):
        train_and_infer.check_inference_layout(TRAINING, 8)
    with pytest.raises(TrainOptionError, match="--infer-tp must be an integer >= 1, got 0"):
        train_and_infer.check_inference_layout(TRAINING, 0)
    with pytest.raises(SystemExit) as exit_info:
        train_and_infer.main(["--tp", "1", "--pp", "1", "--dp", "3", "--infer-tp", "3"])
    assert exit_info.value.code == 2
    assert "--infer-tp 3 does not divide the model's --heads 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        train_and_infer.main(["--cycles", "-1"])
    assert exit_info.value.code == 2
    assert "--cycles must be >= 0, got -1" in capsys.readouterr().err


def built_twice_destroyed_twice_used_after() -> dict:
    """On each rank of a 2-rank world: two tp2 inference collections, destroys and uses."""
    from parallel_state_ng.builders.inference import build_inference_collection, destroy_inference_collection
    from parallel_state_ng.groups.creation import live_groups

    before = len(live_groups())
    first = build_inference_collection(2, tp_size=2, **SIZES)
    second = build_inference_collection(2, tp_size=2, **SIZES)
    out: dict = {"distinct": first.tp is not second.tp, "made": len(live_groups()) - before}
    out["destroyed"] = [destroy_inference_collection(first), destroy_inference_collection(first)]
    value = torch.ones(1)
    dist.all_reduce(value, group=second.tp)  # the other collection still works
    out["second still works"] = float(value)
    errors = []
    # Before torch 2.8 (TORCH_FACTS "unregistered_group_backend_valueerror") torch's exception
    # logger, asking the destroyed group's backend, raises a TypeError in place of the error.
    masked = () if torch_has("unregistered_group_backend_valueerror") else (TypeError,)
    for use in (lambda: first.tp.size(), lambda: dist.all_reduce(torch.ones(1), group=first.dp)):
        try:
            use()
        except (RuntimeError, ValueError, *masked) as error:  # torch's ValueError names the group by its repr
            errors.append(f"{type(error).__name__}: {error}")
    out["errors"] = errors
    out["destroyed second"] = destroy_inference_collection(second)
    out["left"] = len(live_groups()) - before
    return out


def test_building_twice_destroying_twice_and_using_after_destroy(gloo_world):
    pytest.importorskip("megatron.core.process_groups_config")
    for out in gloo_world(2).run(built_twice_destroyed_twice_used_after):
        assert out["distinct"] and out["made"] > 0
        assert out["destroyed"] == [out["made"] // 2, 0]  # the second destroy is a no-op
        assert out["second still works"] == 2.0
        assert len(out["errors"]) == 2
        assert out["errors"][0].startswith("RuntimeError: the inference collection's 'tp' group was destroyed by ")
        if torch_has("unregistered_group_backend_valueerror"):
            assert (
                "the inference collection's 'dp' group, destroyed by destroy_inference_collection" in out["errors"][1]
            )
        else:  # torch's exception logger raised its own TypeError (TORCH_FACTS), as said above
            assert out["errors"][1].startswith("TypeError: Invariant encountered")
        assert out["destroyed second"] == out["made"] // 2 and out["left"] == 0
