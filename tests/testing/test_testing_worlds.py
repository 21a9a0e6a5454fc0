"""The public test worlds (parallel_state_ng/testing/worlds.py) and their pytest plugin.

Simulated ranks: what a rank sees, the default group refused or replaced, bad input. Gloo
worlds: results by rank, a rank that raises, hangs or dies (named, with its traceback, stack or
exit code; the world closed after a hang or a death), bad arguments. The plugin: a user's test
file (docs/testing.md's example) with the plugin enabled by ``-p``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.testing.worlds import (
    GlooWorld,
    WorkerDiedError,
    WorkerError,
    WorldClosedError,
    WorldTimeoutError,
    destroy_simulated_world,
    init_simulated_rank,
    simulated_rank,
)
from tests.support import docs
from tests.support.paths import ROOT

PLUGIN = "parallel_state_ng.testing.pytest_plugin"


# --------------------------------------------------------------------------- simulated ranks
def test_simulated_rank_is_that_rank_and_leaves_nothing():
    with simulated_rank(5, 8) as world:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (5, 8, "fake")
        assert world is dist.group.WORLD
        pair = dist.new_group([4, 5])
        assert dist.get_rank(pair) == 1
    assert not dist.is_initialized()


def test_simulated_rank_refuses_a_group_it_did_not_make(psng_simulated_rank):
    psng_simulated_rank(0, 2)
    existing = dist.group.WORLD
    with pytest.raises(
        RuntimeError, match=r"simulated_rank\(1, 4\) would destroy a group it did not make.*rank 0 of 2"
    ):
        with simulated_rank(1, 4):
            pass
    assert dist.group.WORLD is existing and dist.get_rank() == 0
    with pytest.raises(RuntimeError, match="already exists.*pass replace=True"):
        init_simulated_rank(1, 4)
    init_simulated_rank(3, 4, replace=True)
    assert (dist.get_rank(), dist.get_world_size()) == (3, 4)


def test_the_fixture_reinitializes(psng_simulated_rank):
    psng_simulated_rank(0, 4)
    psng_simulated_rank(6, 1024)
    assert (dist.get_rank(), dist.get_world_size()) == (6, 1024)


def test_an_equal_mesh_of_the_next_world_has_live_flattened_dims(psng_simulated_rank):
    # Before torch 2.10 torch keeps flattened dims process-wide under the (value-compared) root mesh
    from torch.distributed.device_mesh import init_device_mesh

    def flattened_dp_tp() -> list[int]:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        mesh["dp", "tp"]._flatten("dp_tp")
        return dist.get_process_group_ranks(mesh.get_group("dp_tp"))

    psng_simulated_rank(5, 8)
    assert flattened_dp_tp() == [4, 5, 6, 7]
    psng_simulated_rank(5, 8)  # replaces the world
    assert flattened_dp_tp() == [4, 5, 6, 7]
    destroy_simulated_world()
    with simulated_rank(5, 8):
        assert flattened_dp_tp() == [4, 5, 6, 7]
    with simulated_rank(5, 8):
        assert flattened_dp_tp() == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "rank,world_size,error,message",
    [
        (0, 0, ValueError, r"world_size must be >= 1, got 0"),
        (2, 2, ValueError, r"rank must be in \[0, world_size=2\), got 2"),
        (-1, 4, ValueError, r"rank must be in \[0, world_size=4\), got -1"),
        (0, True, TypeError, r"world_size must be an int, got True \(bool\)"),
        ("0", 2, TypeError, r"rank must be an int, got '0' \(str\)"),
        (1.0, 2, TypeError, r"rank must be an int, got 1.0 \(float\)"),
    ],
)
def test_simulated_rank_bad_input(rank, world_size, error, message):
    with pytest.raises(error, match=message):
        with simulated_rank(rank, world_size):
            pass
    with pytest.raises(error, match=message):
        init_simulated_rank(rank, world_size)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- gloo worlds
def _sum_of_ranks() -> float:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return total.item()


def _scaled_rank(factor: int, *, offset: int) -> int:
    return dist.get_rank() * factor + offset


def _fail_on_rank_one() -> str:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return "ok"


def _sleep_on_rank_one(seconds: float) -> str:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return "awake"


def _exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def test_results_by_rank(gloo_world):
    world = gloo_world(2)
    assert world.run(_sum_of_ranks) == [1.0, 1.0]
    assert world.run_per_rank(_scaled_rank, [(10,), (20,)], offset=1) == [1, 21]


def test_a_rank_that_raises_is_named_with_its_traceback(gloo_world):
    world = gloo_world(2)
    with pytest.raises(WorkerError) as info:
        world.run(_fail_on_rank_one)
    assert list(info.value.errors) == [1] and info.value.errors[1][0] == "ValueError"
    message = str(info.value)
    assert "rank(s) [1] raised" in message and "--- rank 1 raised ValueError" in message
    assert "in _fail_on_rank_one" in message and "ValueError: boom on rank 1" in message
    assert world.run(_sum_of_ranks) == [1.0, 1.0]  # every rank finished: the world goes on


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hung_rank_is_named_with_its_stack_and_the_world_closes():
    world = GlooWorld(2)
    try:
        # The first call imports this module in each worker, which can take seconds on a loaded
        # machine; after it, only the sleep can outlast the timeout.
        assert world.run(_sum_of_ranks) == [1.0, 1.0]
        with pytest.raises(WorldTimeoutError) as info:
            world.run(_sleep_on_rank_one, 30, timeout=2)
    finally:
        world.close()
    error = info.value
    assert error.unfinished == [1] and list(error.stacks) == [1]
    assert 'test_testing_worlds.py", line' in error.stacks[1] and "in _sleep_on_rank_one" in error.stacks[1]
    assert "rank(s) [1] did not finish within 2.0 s; the world is closed" in str(error)
    assert "--- rank 1: stack at the timeout" in str(error) and "in _sleep_on_rank_one" in str(error)
    assert world.closed
    with pytest.raises(WorldClosedError, match=r"GlooWorld\(2\) is closed \(.*_sleep_on_rank_one: rank\(s\) \[1\]"):
        world.run(_sum_of_ranks)


@pytest.mark.multiprocess
def test_a_dead_rank_is_named_with_its_exit_code():
    world = GlooWorld(2)
    try:
        with pytest.raises(WorkerDiedError, match=r"process of rank\(s\) \[1\] ended \(rank 1: exit code 3\)") as info:
            world.run(_exit_on_rank_one)
    finally:
        world.close()
    assert info.value.exit_codes == {1: 3} and world.closed
    with pytest.raises(WorldClosedError):
        world.run(_sum_of_ranks)


def _local_function_holder():
    def local():
        return 1

    return local


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"world_size": 0}, ValueError, r"world_size must be >= 1, got 0"),
        ({"world_size": 2.0}, TypeError, r"world_size must be an int, got 2.0"),
        ({"world_size": True}, TypeError, r"world_size must be an int, got True"),
        ({"world_size": 2, "timeout": 0}, ValueError, r"timeout must be a positive, finite number of seconds, got 0"),
        ({"world_size": 2, "timeout": float("inf")}, ValueError, r"timeout must be .* got inf"),
        ({"world_size": 2, "timeout": "5"}, TypeError, r"timeout must be a number of seconds, got '5'"),
        ({"world_size": 2, "start_timeout": -1}, ValueError, r"start_timeout must be a positive.*got -1"),
        (
            {"world_size": 2, "env": {"OMP_NUM_THREADS": 1}},
            TypeError,
            r"env must map str to str, got \{'OMP_NUM_THREADS': 1\}",
        ),
    ],
)
def test_bad_world_arguments_fail_before_any_process(kwargs, error, message):
    with pytest.raises(error, match=message):
        GlooWorld(**kwargs)


@pytest.mark.parametrize(
    "call,error,message",
    [
        (
            lambda w: w.run(lambda: 1),
            TypeError,
            r"fn=tests.testing.test_testing_worlds\..*<lambda> is a lambda: the workers import fn by module and name",
        ),
        (
            lambda w: w.run(_local_function_holder()),
            TypeError,
            r"fn=.*_local_function_holder.<locals>.local is a local function",
        ),
        (lambda w: w.run("_sum_of_ranks"), TypeError, r"fn must be callable, got '_sum_of_ranks'"),
        (lambda w: w.run(_sum_of_ranks, timeout=0), ValueError, r"timeout must be a positive.*got 0"),
        (
            lambda w: w.run_per_rank(_scaled_rank, [(1,)], offset=0),
            ValueError,
            r"one argument tuple per rank \(world_size=2\), got 1",
        ),
        (
            lambda w: w.run_per_rank(_scaled_rank, [(1,), 2], offset=0),
            TypeError,
            r"args_by_rank\[1\] must be a tuple or list",
        ),
        (
            lambda w: w.run(_scaled_rank, threading.Lock(), offset=0),
            TypeError,
            r"arguments of .*_scaled_rank for rank 0 cannot be pickled",
        ),
    ],
    ids=["lambda", "local", "not-callable", "timeout", "rank-count", "rank-args", "unpicklable"],
)
def test_bad_run_arguments_are_refused_and_the_world_goes_on(gloo_world, call, error, message):
    world = gloo_world(2)
    with pytest.raises(error, match=message):
        call(world)
    assert not world.closed and world.run(_sum_of_ranks) == [1.0, 1.0]


# --------------------------------------------------------------------------- the pytest plugin
@pytest.fixture
def environment_before_pytester():
    """The environment before pytester changes it (HOME, PY_COLORS, ...)."""
    return dict(os.environ)


@pytest.mark.multiprocess
def test_the_plugin_serves_a_users_test_file(environment_before_pytester, pytester, monkeypatch):
    # The example of docs/testing.md is the user's test file.
    (example,) = [b for b in docs.parse("docs/testing.md") if b.kind == "python" and "psng_gloo_world" in b.code]
    pytester.makepyfile(test_example=example.code)
    pytester.makepyfile(
        test_session_worlds="""
def test_the_ini_timeout(psng_gloo_world):
    assert psng_gloo_world(2).timeout == 45.0


def test_a_closed_world_is_replaced(psng_gloo_world):
    first = psng_gloo_world(2)
    assert psng_gloo_world(2) is first
    first.close()
    second = psng_gloo_world(2)
    assert second is not first and not second.closed and second.run(len, "ab") == [2, 2]
"""
    )
    pytester.makeini("[pytest]\npsng_gloo_timeout = 45\n")
    # The session's fork server serves only the environment it started with: keep that (else the
    # workers are spawned); PYTEST_ADDOPTS stays out of the inner run, as pytester wants.
    for name in (set(os.environ) | set(environment_before_pytester)) - {"PYTEST_ADDOPTS"}:
        if name in environment_before_pytester:
            monkeypatch.setenv(name, environment_before_pytester[name])
        else:
            monkeypatch.delenv(name)
    result = pytester.runpytest("-p", PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    bad = pytester.runpytest("-p", PLUGIN, "-p", "no:cacheprovider", "--psng-gloo-timeout=0")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--psng-gloo-timeout must be a positive number of seconds, got '0'*"])


def test_the_plugin_is_not_loaded_automatically():
    # An entry point in the pytest11 group would load it into every pytest run of an environment
    # where the package is installed.
    assert "pytest11" not in Path(ROOT, "setup.py").read_text(encoding="utf-8")


def test_a_test_failing_halfway_leaves_no_model_parallelism_behind(pytester):
    """The simulated rank's teardown destroys the model parallelism a failed test left initialized."""
    pytester.makepyfile(
        test_halfway="""
import compat.parallel_state as ps

def test_fails_while_initialized(psng_simulated_rank):
    psng_simulated_rank(3, 8)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    raise AssertionError("halfway")

def test_the_next_starts_clean(psng_simulated_rank):
    assert not ps.model_parallel_is_initialized()
    psng_simulated_rank(0, 8)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    ps.destroy_model_parallel()
"""
    )
    result = pytester.runpytest_inprocess("-p", PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: halfway*"])
