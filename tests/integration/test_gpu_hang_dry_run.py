"""The GPU check's hang part (``--world-checks hang``, scripts/gpu/world_hang.py) dry-run on 8 gloo ranks.

Bound mode (the split path through the gloo stand-in, groups shared under ``safe``: a report names
every kind of a shared group): each of the six stall cases gives a PASS row, the live report and
``diagnose`` on the dumps both naming the culprit, kind and coordinates. On a GPU the same bodies
run on NCCL (docs/reliability.md, "When a job hangs").
"""

from __future__ import annotations

import importlib.util

import pytest

from scripts.gpu import check
from scripts.gpu.world_hang import SHARED_WORLD_CASES
from tests.integration.test_gpu_check import _world_dry_run


def test_the_hang_part_is_planned_at_8_ranks_within_its_limit():
    args = check.parse_args(
        ["--world", "4", "--world-only", "--no-tests", "--world-modes", "bound", "--world-checks", "hang"]
    )
    assert check.world_plan(args).worlds("nccl") == [(8, "bound", "hang", 195.0)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.rotating(5, 10)  # end-to-end part 6 of 10 (docs/testing.md, "Rotating parts")
def test_cpu_dry_run_of_the_hang_part_passes(tmp_path):
    _, rows = _world_dry_run(tmp_path, "--world-modes", "bound", "--world-checks", "hang")
    assert len(rows) == len(SHARED_WORLD_CASES) + 1 and all(r.startswith("PASS") for r in rows), rows
