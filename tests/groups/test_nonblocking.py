"""Nonblocking NCCL init under the failure bound (``parallel_state_ng.groups.nonblocking``).

torch waits for a nonblocking communicator up to ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` seconds (30
minutes unset), read once per process: a build on the split path refuses, before its first
split, a nonblocking world whose wait the bound cannot hold; ``prepare_nonblocking_timeout``
sets the wait from the bound before ``init_process_group``. The environment handling on CPU;
the survivors of a death, bounded, on gloo in ``tests/compat/test_split_gloo.py``.
"""

from __future__ import annotations

import pytest

from parallel_state_ng.groups import nonblocking
from parallel_state_ng.groups.liveness import ENV_FAILURE_TIMEOUT
from parallel_state_ng.groups.nonblocking import (
    ENV_NONBLOCKING,
    ENV_NONBLOCKING_TIMEOUT,
    NonblockingBoundError,
    check_nonblocking_bound,
    max_nonblocking_timeout,
    nonblocking_mode,
    prepare_nonblocking_timeout,
)
from tests.support.worlds.split_recorder import SplitRecorder, creation_env, recording


@pytest.fixture
def env(monkeypatch):
    for name in (ENV_NONBLOCKING, ENV_NONBLOCKING_TIMEOUT, ENV_FAILURE_TIMEOUT):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("bound", "limit"), [(30.0, 12), (20.0, 8), (5.0, 1), (4.0, 0), (300.0, 147)])
def test_the_longest_wait_each_bound_holds(bound, limit):
    # two waits of T + 1 s each, then the grace (1 to 3 s): within the bound
    assert max_nonblocking_timeout(bound) == limit
    if limit >= 1:
        grace = max(1.0, min(3.0, 0.1 * bound))
        assert 2 * (limit + 1) + grace <= bound < 2 * (limit + 2) + grace


@pytest.mark.parametrize(("value", "on"), [(None, False), ("0", False), ("1", True), ("true", False), ("yes", False)])
def test_nonblocking_mode_reads_the_variable_as_torch_does(env, value, on):
    if value is not None:
        env.setenv(ENV_NONBLOCKING, value)
    assert nonblocking_mode() is on  # torch's check_env: only "0" and "1" count


def test_blocking_init_and_an_unbounded_world_are_not_checked(env):
    env.setenv(ENV_NONBLOCKING_TIMEOUT, "99999")
    check_nonblocking_bound()  # blocking NCCL: torch's nonblocking wait plays no part
    env.setenv(ENV_NONBLOCKING, "1")
    env.setenv(ENV_FAILURE_TIMEOUT, "0")
    check_nonblocking_bound()  # the bound is off: the user accepts torch's wait


@pytest.mark.parametrize(
    ("timeout", "why"),
    [
        (None, "TORCH_NCCL_NONBLOCKING_TIMEOUT is unset, so torch waits 1800 s"),
        ("13", "TORCH_NCCL_NONBLOCKING_TIMEOUT=13 s is longer than the bound allows (12 s)"),
        ("0", "TORCH_NCCL_NONBLOCKING_TIMEOUT=0: torch gives up on the first wait"),
    ],
)
def test_a_wait_the_bound_cannot_hold_is_refused(env, timeout, why):
    env.setenv(ENV_NONBLOCKING, "1")
    if timeout is not None:
        env.setenv(ENV_NONBLOCKING_TIMEOUT, timeout)
    with pytest.raises(NonblockingBoundError) as info:
        check_nonblocking_bound()
    text = str(info.value)
    assert text.startswith("nonblocking NCCL init with the failure bound PSNG_FAILURE_TIMEOUT=30 s"), text
    assert why in text, text
    assert "set TORCH_NCCL_NONBLOCKING_TIMEOUT to a whole number from 1 to 12" in text, text


def test_a_wait_within_the_bound_passes_and_a_bad_value_is_named(env):
    env.setenv(ENV_NONBLOCKING, "1")
    env.setenv(ENV_FAILURE_TIMEOUT, "20")
    env.setenv(ENV_NONBLOCKING_TIMEOUT, "8")
    check_nonblocking_bound()
    env.setenv(ENV_NONBLOCKING_TIMEOUT, "7.5")
    with pytest.raises(NonblockingBoundError, match="must be a whole number of seconds .*got '7.5'"):
        check_nonblocking_bound()
    env.setenv(ENV_FAILURE_TIMEOUT, "3")
    env.setenv(ENV_NONBLOCKING_TIMEOUT, "1")
    with pytest.raises(NonblockingBoundError, match="the failure bound is too short for nonblocking NCCL"):
        check_nonblocking_bound()


def test_prepare_sets_the_wait_from_the_bound_and_keeps_a_good_one(env):
    assert prepare_nonblocking_timeout() is None  # blocking: nothing to bound, nothing set
    assert ENV_NONBLOCKING_TIMEOUT not in nonblocking.os.environ
    env.setenv(ENV_NONBLOCKING, "1")
    env.setenv(ENV_FAILURE_TIMEOUT, "20")
    assert prepare_nonblocking_timeout() == 8
    assert nonblocking.os.environ[ENV_NONBLOCKING_TIMEOUT] == "8"
    check_nonblocking_bound()
    env.setenv(ENV_NONBLOCKING_TIMEOUT, "5")
    assert prepare_nonblocking_timeout() == 5  # a value within the bound is kept
    env.setenv(ENV_NONBLOCKING_TIMEOUT, "600")
    with pytest.raises(NonblockingBoundError, match="TORCH_NCCL_NONBLOCKING_TIMEOUT=600 s is longer"):
        prepare_nonblocking_timeout()
    assert nonblocking.os.environ[ENV_NONBLOCKING_TIMEOUT] == "600"  # never overwritten


def test_compat_refuses_before_its_first_split(psng_simulated_rank, env):
    import compat.parallel_state as ps

    psng_simulated_rank(1, 8)
    env.setenv(ENV_NONBLOCKING, "1")
    with recording(SplitRecorder()) as recorder, creation_env("split"):
        with pytest.raises(NonblockingBoundError, match="TORCH_NCCL_NONBLOCKING_TIMEOUT is unset"):
            ps.initialize_model_parallel(
                tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
            )
        assert recorder.calls == []  # no split made, nothing to undo
        assert not ps.model_parallel_is_initialized()
        env.setenv(ENV_NONBLOCKING_TIMEOUT, "12")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
        )
        assert len(recorder.calls) > 10
        ps.destroy_model_parallel()
