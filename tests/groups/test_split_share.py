"""``PSNG_NCCL_SPLIT_SHARE`` is gone: it saved nothing, and setting it is refused with the real knob.

NCCL shares a split's resources when the parent communicator's config has ``splitShare``
(NVIDIA/nccl ``src/init.cc``, ``ncclCommSplit``), never because of the child's; the switch set
the child's (docs/results/gpus.md, "Split sharing"). A simulated rank of 8 on the split path,
``split_group`` recorded (tests/support/worlds/split_recorder.py): no split's options carry
``split_share``; the variable set to anything but ``0`` makes the build raise before any split.
"""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from parallel_state_ng.groups.split import ENV_SPLIT_SHARE
from tests.support.worlds.split_recorder import SplitRecorder, creation_env, recording


class _Options:
    """Stands in for ``ProcessGroupNCCL.Options``: a ``config`` with fields and a stream priority."""

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self.config = types.SimpleNamespace(split_share=0)


def _splits(monkeypatch, share: str | None) -> list:
    import compat.parallel_state as ps

    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=_Options), raising=False)
    if share is None:
        monkeypatch.delenv(ENV_SPLIT_SHARE, raising=False)
    else:
        monkeypatch.setenv(ENV_SPLIT_SHARE, share)
    with recording(SplitRecorder()) as recorder, creation_env("split"):
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
            )
            ps.destroy_model_parallel()
        finally:
            calls = recorder.calls
    return calls


@pytest.mark.parametrize("share", [None, "0"])
def test_no_split_asks_for_sharing(psng_simulated_rank, monkeypatch, share):
    psng_simulated_rank(1, 8)
    calls = _splits(monkeypatch, share)
    assert len(calls) > 10
    assert not any(getattr(getattr(call[2], "config", None), "split_share", 0) for call in calls), calls


@pytest.mark.parametrize("share", ["1", "yes"])
def test_the_removed_switch_is_refused_before_any_split(psng_simulated_rank, monkeypatch, share):
    import compat.parallel_state as ps

    psng_simulated_rank(1, 8)
    with pytest.raises(ValueError, match=f"environment variable PSNG_NCCL_SPLIT_SHARE='{share}' was removed") as info:
        _splits(monkeypatch, share)
    assert "NCCL_COMM_SPLIT_SHARE_RESOURCES=1" in str(info.value)
    assert not ps.model_parallel_is_initialized()
