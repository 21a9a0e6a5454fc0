"""The memory switch: ``PSNG_NCCL_SPLIT_SHARE=1`` gives every split NCCL's ``split_share``.

A simulated rank of 8 on the split path, ``split_group`` recorded (tests/support/worlds/split_recorder.py),
a stand-in for ``ProcessGroupNCCL.Options`` (this torch may have no NCCL): with the switch on every
split's options carry ``config.split_share == 1``; off (the default) none does; a bad value is refused.
"""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from parallel_state_ng.groups.split import ENV_SPLIT_SHARE, split_share_enabled
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
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
        )
        ps.destroy_model_parallel()
    return recorder.calls


def test_the_switch_gives_every_split_split_share(psng_simulated_rank, monkeypatch):
    psng_simulated_rank(1, 8)
    calls = _splits(monkeypatch, "1")
    assert len(calls) > 10
    assert all(call[2] is not None and call[2].config.split_share == 1 for call in calls), calls


def test_off_by_default_and_bad_values_refused(psng_simulated_rank, monkeypatch):
    psng_simulated_rank(1, 8)
    assert not any(call[2] is not None and call[2].config.split_share for call in _splits(monkeypatch, None))
    assert not split_share_enabled()
    monkeypatch.setenv(ENV_SPLIT_SHARE, "yes")
    with pytest.raises(ValueError, match="PSNG_NCCL_SPLIT_SHARE must be 0 or 1, got 'yes'"):
        split_share_enabled()
