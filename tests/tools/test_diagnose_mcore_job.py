"""An MCore-created job (megatron-core 0.19.2's own ``initialize_model_parallel``, no compat) through
``parallel-state-ng diagnose``.

8 gloo ranks, tp2 pp2 dp2, torch's flight recorder on (``TORCH_FR_BUFFER_SIZE``). Rank 3 sleeps
before the step's tp all-reduce; 1.5 s into the step every rank writes torch's own dump (as the
NCCL watchdog would at its timeout), then rank 3 goes on and the step completes. The tool reads
the dumps with a layout snapshot (the regression kit's format) and names rank 3, the tp group
at dp=1 pp=0, from Megatron's own group descriptions.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.testing.worlds import GlooWorld
from tests.support.releases.wheels import release_dir

CULPRIT = 3


def _mcore_step(fr_dir: str) -> str:
    from parallel_state_ng.testing.megatron_cpu import use_megatron_path

    use_megatron_path()
    from megatron.core import parallel_state as mps

    mps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    try:
        x = torch.ones(4)
        dist.all_reduce(x, group=mps.get_tensor_model_parallel_group())
        dist.all_reduce(x, group=mps.get_data_parallel_group())
        path = os.path.join(fr_dir, f"nccl_trace_rank_{dist.get_rank()}")

        def dump() -> None:
            trace = torch._C._distributed_c10d._dump_fr_trace(True, False, False)
            with open(path, "wb") as handle:
                handle.write(trace)

        timer = threading.Timer(1.5, dump)
        timer.start()
        if dist.get_rank() == CULPRIT:
            time.sleep(2.5)
        dist.all_reduce(x, group=mps.get_tensor_model_parallel_group())
        dist.all_reduce(x, group=mps.get_data_parallel_group())
        timer.join()
        return mps.get_tensor_model_parallel_group().group_desc
    finally:
        mps.destroy_model_parallel()


@pytest.mark.multiprocess
@pytest.mark.rotating(8, 10)  # end-to-end part 9 of 10 (docs/testing.md, "Rotating parts")
def test_mcore_job_diagnosed_offline(tmp_path):
    from parallel_state_ng.__main__ import main

    env = {"TORCH_FR_BUFFER_SIZE": "2000", "PSNG_MEGATRON_PATH": str(release_dir("0.19.2"))}
    fr = tmp_path / "fr"
    fr.mkdir()
    with GlooWorld(8, env=env, timeout=90) as world:
        descs = world.run(_mcore_step, str(fr), timeout=60)
    assert set(descs) == {"TENSOR_MODEL_PARALLEL_GROUP"}  # Megatron named its groups, not us
    snapshot = tmp_path / "layout.json"
    layout_args = ["--world-size", "8", "--tp", "2", "--pp", "2", "--release", "0.19"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["layout", *layout_args, "--format", "json", "-o", str(snapshot)]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["diagnose", str(fr), "--layout", str(snapshot)])
    first = out.getvalue().splitlines()[0]
    assert code == 0, out.getvalue()
    assert f"likely culprit rank {CULPRIT} (tp=1 dp=1 pp=0), in no collective" in first, out.getvalue()
    assert "stuck group tp at dp=1 pp=0 (TENSOR_MODEL_PARALLEL_GROUP), ranks [2, 3]" in first, out.getvalue()
