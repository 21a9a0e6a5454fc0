"""scripts/gpu/check.py: its CPU dry run passes every check it can run, and it refuses clearly.

The dry run (gloo, world size 1, a stand-in for NCCL's options, the tiny GPT on the CPU) is
what this machine can prove of the GPU check; the NCCL and device-bound parts run only on a
GPU (docs/results/gpus.md, "The GPU check").
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import ROOT


def _check(*options: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PSNG_CREATION_PATH", None)
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, "-m", "scripts.gpu", "check", *options],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_cpu_dry_run_passes_every_check(tmp_path):
    report = tmp_path / "report.txt"
    proc = _check("--cpu-dry-run", "--no-tests", "--output", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = report.read_text()
    assert text in proc.stdout  # printed and written alike
    for line in ("# GPU check (CPU DRY RUN", "date: ", "torch ", "NCCL: none", "GPU: none", "megatron-core: "):
        assert line in text
    assert "creation path: member" in text
    assert "torch split_group available: True" in text
    checks = [line for line in text.splitlines() if re.match(r"^(PASS|FAIL)  ", line)]
    assert len(checks) == 6 and all(line.startswith("PASS") for line in checks), checks
    assert "0 mismatch(es)" in text
    # the options table: MCore's YAML and high-priority groups reached the stand-in options
    table = {line.split()[0]: line for line in text.splitlines() if re.match(r"^[A-Z_]+_GROUP(_[A-Z]+)* ", line)}
    assert "max_ctas=16 min_ctas=4" in table["TENSOR_MODEL_PARALLEL_GROUP"]
    assert "hp=True" in table["CONTEXT_PARALLEL_GROUP"] and "hp=True" in table["DATA_PARALLEL_GROUP"]
    assert all(line.rstrip().endswith("same") for line in table.values())
    assert re.search(r"registered groups 1 -> \d+ after init -> 1 after destroy", text)
    assert "summary: 6 passed, 0 failed" in text


def _world_dry_run(tmp_path, *options: str) -> tuple[str, list[str]]:
    """The N-rank checks' dry run on 4 gloo ranks (exit 0 asserted): the report and its PASS/FAIL lines."""
    report = tmp_path / "report.txt"
    proc = _check(
        "--cpu-dry-run", "--no-tests", "--world-only", "--world", "4", *options, "--output", str(report), timeout=600
    )
    text = report.read_text()
    assert proc.returncode == 0, text
    return text, [line for line in text.splitlines() if re.match(r"^(PASS|FAIL)  ", line)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.rotating(2, 10)  # end-to-end part 3 of 10 (docs/testing.md, "Rotating parts")
def test_cpu_dry_run_of_the_n_rank_checks_passes(tmp_path):
    # the 8/16-rank GPU checks' bodies on 4 gloo ranks: lazy, bound (the split path through the
    # gloo stand-in) and a rank's death in the split sequence
    text, checks = _world_dry_run(
        tmp_path, "--world-checks", "groups,builders,death,death-nonblocking"
    )  # training: below
    assert checks and all(line.startswith("PASS") for line in checks), checks
    names = {line.split(":")[0][6:] for line in checks}
    for mode in ("lazy", "bound"):
        for what in ("creation path", "membership equals MCore's", "NCCL options and timeouts equal MCore's"):
            assert f"4 ranks gloo {mode} tp2 pp2" in names and any(what in line for line in checks)
    assert "4 ranks gloo bound tp2 pp2: creation path: ['split'] (expected split)" in text
    assert "4 ranks gloo lazy tp2 pp2: creation path: ['member'] (expected member)" in text
    for how in ("blocking", "nonblocking"):
        assert any(f"split 3 ({how} NCCL init)" in line and "naming rank 3: True" in line for line in checks), how
    # nonblocking: refused without a bounded wait; with TORCH_NCCL_NONBLOCKING_TIMEOUT=8 (a 20 s bound) named
    assert "PASS  4 ranks gloo bound nonblocking NCCL init without a bounded wait: refused before any split" in text
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT=8)" in text
    assert "## mode lazy" not in text  # --world-only


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.rotating(9, 10)  # end-to-end part 10 of 10 (docs/testing.md, "Rotating parts")
def test_cpu_dry_run_of_the_n_rank_training_passes(tmp_path):
    # the 8-rank training check's body on 4 gloo ranks, bound mode (compat on the split path through
    # the gloo stand-in): tp2 pp2 dp1 and tp1 pp2 dp2 ep2, MCore then compat in each rank, bit for bit.
    # The 8-rank dry run is a documented command (docs/testing.md): it costs minutes of CPU here.
    text, checks = _world_dry_run(tmp_path, "--world-modes", "bound", "--world-checks", "training")
    assert len(checks) == 7 and all(line.startswith("PASS") for line in checks), checks
    for label in ("tp2 pp2 dp1", "tp1 pp2 dp2 ep2 experts4 alltoall"):
        tag = f"PASS  4 ranks gloo bound training {label}"
        assert f"{tag}: bit-identical to MCore: 4 ranks on cpu (cpu), 3 steps;" in text
        assert "each equal to MCore's: True" in text
        assert f"{tag}: megatron's code used compat: " in text
        assert f"{tag}: no group left after compat's destroy: compat left [0, 0, 0, 0]" in text
    assert "worlds: 1 (training; modes bound)" in text


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_without_a_gpu_it_exits_2_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    proc = _check()
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA GPU found"), proc.stdout


@pytest.mark.multiprocess
def test_the_bound_mode_has_no_dry_run():
    proc = _check("--cpu-dry-run", "--modes", "lazy,bound")
    assert proc.returncode == 2
    assert "cannot run the bound mode" in proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.rotating(1, 10)  # end-to-end part 2 of 10 (docs/testing.md, "Rotating parts")
def test_cpu_dry_run_of_the_split_share_measurement(tmp_path):
    # both worlds of scripts/gpu/split_share.py on 4 gloo ranks, bound (the split stand-in): the
    # figures are GPU-only (no device memory here), the plumbing and the report are not
    out = tmp_path / "split_share.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PSNG_CREATION_PATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.gpu", "split_share", "--cpu-dry-run", "--world", "4", "--layout", "tp2-pp2"]
        + ["--timeout", "240", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("worst case 510 s: 2 worlds of 4 ranks")
    import json

    rows = json.loads(out.read_text())
    assert [row["world"] for row in rows] == ["no sharing", "NCCL_COMM_SPLIT_SHARE_RESOURCES=1"]
    assert all(row["device_held_mib"] is None and row["groups_used_rank0"] > 5 for row in rows), rows
