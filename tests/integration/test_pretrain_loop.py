"""Megatron-LM's own training loop (``megatron.training.pretrain``) under compat and under MCore.

``python -m scripts.examples train_gpt --loop training`` is run as a user runs it, on megatron-core 0.17.1's
unzipped wheel (``--megatron-path``; the first release that ships ``megatron/training``): 4 CPU
processes, tp 2 pp 2 through Megatron's own argument parser; and on 0.19.2, 2 processes, pp 2.
MCore's parallel_state and compat must report the same loss and gradient norm at every
iteration and the same digest of every rank's final parameters, and the compat runs must really
have used compat. Each install point runs once: compat installed after megatron's import on
0.17.1, before it on 0.19.2 (the core-loop tests in test_train_gpt.py run both on every layout;
docs/results/training.md's tables ran both here). On 0.19.2 also with every communicator asleep and
awake again between iterations (``--sleep-wake``, issue 51), 2 processes, dp 2 with the
distributed optimizer and both overlaps, against MCore. The script's own option errors are
checked without starting processes.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from scripts.examples import train_gpt
from scripts.examples.gpt import pretrain_cli
from tests.support.paths import ROOT
from tests.support.releases.wheels import release_dir

RELEASE = "0.17.1"
LAYOUT = ["--nproc", "4", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
ITERATIONS = 3


def _pretrain(*options: str) -> dict:
    """Run the script; the iterations, digest and facts it prints."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-m", "scripts.examples", "train_gpt", "--loop", "training", "--quiet", *options],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    out = done.stdout
    iterations = re.findall(r"^iteration (\d+): lm loss (\S+)  grad norm (\S+)$", out, re.M)
    losses = re.search(r"^losses: \[(.*)\]$", out, re.M)
    digest = re.search(r"^parameter digest: ([0-9a-f]{64})$", out, re.M)
    used = re.search(r"^megatron-core (\S+); parallel_state used: (\S+)$", out, re.M)
    assert iterations and losses and digest and used, out
    slept = re.search(r"^sleep/wake cycles .*: \[(.*)\]; rank 0's groups by mechanism: (.*)$", out, re.M)
    return {
        "iterations": [int(i) for i, _, _ in iterations],
        "losses": [float(x) for x in losses.group(1).split(", ")],
        "grad_norms": [n for _, _, n in iterations],
        "digest": digest.group(1),
        "version": used.group(1),
        "parallel_state": used.group(2),
        "sleep_cycles": [int(x) for x in slept.group(1).split(", ")] if slept else None,
        "fenced": int(re.search(r"'fenced': (\d+)", slept.group(2)).group(1)) if slept else None,
    }


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.rotating(4, 10)  # end-to-end part 5 of 10 (docs/testing.md, "Rotating parts")
def test_megatron_pretrain_is_bit_identical_under_compat():
    path = str(release_dir(RELEASE))
    common = ["--megatron-path", path, *LAYOUT, "--train-iters", str(ITERATIONS)]
    mcore = _pretrain("--impl", "mcore", *common)
    assert mcore["version"] == RELEASE and mcore["parallel_state"] == "megatron.core.parallel_state"
    assert mcore["iterations"] == list(range(1, ITERATIONS + 1))
    assert all(math.isfinite(x) and 0 < x < 2 * math.log(128) for x in mcore["losses"]), mcore["losses"]
    assert len(set(mcore["losses"])) == ITERATIONS  # it trains: every iteration reports its own loss
    run = _pretrain("--impl", "compat", "--install", "after", *common)
    assert run["parallel_state"] == "compat.parallel_state"
    for key in ("iterations", "losses", "grad_norms", "digest", "version"):
        assert run[key] == mcore[key], f"compat installed after megatron's import: {key} differs from MCore"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.rotating(7, 10)  # end-to-end part 8 of 10 (docs/testing.md, "Rotating parts")
def test_megatron_pretrain_follows_0_19_api_bit_identically():
    # 0.19's pretrain takes a PretrainConfigContainer first and reads arguments parsed before the
    # call; the script builds both as that release expects. Kept small for CI: 2 processes, pp 2,
    # 2 iterations, MCore and compat installed before megatron's import.
    path = str(release_dir("0.19.2"))
    common = ["--megatron-path", path, "--nproc", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "2"]
    mcore = _pretrain("--impl", "mcore", *common)
    assert mcore["version"] == "0.19.2" and mcore["parallel_state"] == "megatron.core.parallel_state"
    assert mcore["iterations"] == [1, 2] and len(set(mcore["losses"])) == 2
    assert all(math.isfinite(x) and 0 < x < 2 * math.log(128) for x in mcore["losses"]), mcore["losses"]
    run = _pretrain("--impl", "compat", "--install", "before", *common)
    assert run["parallel_state"] == "compat.parallel_state"
    for key in ("iterations", "losses", "grad_norms", "digest", "version"):
        assert run[key] == mcore[key], f"0.19.2, compat installed before: {key} differs from MCore"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.rotating(4, 10)  # end-to-end part 5 of 10 (docs/testing.md, "Rotating parts")
def test_megatron_pretrain_with_sleep_and_wake_between_iterations_is_bit_identical():
    # Issue 51 through Megatron's own loop: every communicator asleep and awake again after each
    # of 5 iterations (the hook wraps the release's post_training_step_callbacks; compat
    # installed after megatron's import), dp 2 with the distributed optimizer and both overlaps,
    # against MCore without sleep (2 processes: ~31 s of CPU for both runs; pp 2 dp 2 on 4
    # processes was bit-identical too, docs/results/compat.md "Sleep and wake").
    path = str(release_dir("0.19.2"))
    common = ["--megatron-path", path, "--nproc", "2", "--train-iters", "5"]
    common += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    mcore = _pretrain("--impl", "mcore", *common)
    assert mcore["iterations"] == [1, 2, 3, 4, 5] and len(set(mcore["losses"])) == 5
    run = _pretrain("--impl", "compat", "--install", "after", "--sleep-wake", *common)
    assert run["parallel_state"] == "compat.parallel_state"
    assert run["sleep_cycles"] == [5, 5] and run["fenced"] > 0, run
    for key in ("iterations", "losses", "grad_norms", "digest", "version"):
        assert run[key] == mcore[key], f"0.19.2 with sleep and wake between iterations: {key} differs from MCore"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nproc", "6", "--tensor-model-parallel-size", "4"], "--nproc 6 is not a multiple of tp * pp * cp = 4"),
        (["--impl", "megatron"], "invalid choice: 'megatron'"),
        (["--install", "later"], "invalid choice: 'later'"),
        (["--impl", "mcore", "--sleep-wake"], "--sleep-wake needs --impl compat (MCore has no sleep)"),
    ],
)
def test_training_loop_option_errors_come_before_any_process(options, message, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(pretrain_cli, "run_ranks", lambda *a, **kw: started.append(a))
    assert train_gpt.main(["--loop", "training", *options]) == 2
    assert message in capsys.readouterr().err
    assert not started


def test_training_loop_passes_megatron_options_through():
    run = pretrain_cli.parse_args(
        ["--impl", "mcore", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--lr", "1e-3"]
    )
    assert run.nproc == 4 and run.impl == "mcore" and run.install == "after"
    assert run.megatron_args == ("--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--lr", "1e-3")
    assert pretrain_cli.parse_args(["--nproc", "8", "--tensor-model-parallel-size", "2"]).nproc == 8
