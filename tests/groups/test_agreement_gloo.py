"""The cross-rank agreement check: real gloo worlds of 4, and the protocol on in-process stores.

On a gloo world a rank that passes different arguments to ``initialize_model_parallel`` makes
every rank raise :class:`ParallelConfigMismatchError` (MCore hangs); a rank that never calls
it makes the others raise :class:`ParallelConfigTimeoutError` naming it. After each failure
the persistent world must still work for the next test.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch.distributed as dist

from parallel_state_ng.groups import agreement, pipeline
from parallel_state_ng.groups.agreement import (
    ParallelConfigMismatchError,
    ParallelConfigTimeoutError,
    canonical_json,
    check_agreement,
)


# --------------------------------------------------------------------------- rank functions
def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _init_outcome(kwargs: dict, timeout_s: float | None = None) -> dict:
    """Call compat's initialize_model_parallel with ``kwargs``; report what happened."""
    import compat.parallel_state as ps

    previous = agreement.set_agreement_check(None, timeout_s)
    live = _live_groups()
    start = time.monotonic()
    try:
        ps.initialize_model_parallel(**kwargs)
    except Exception as exc:  # the outcome is the point
        outcome = {"error": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, ParallelConfigTimeoutError):
            outcome["missing"] = exc.missing_rank_list()
        if isinstance(exc, ParallelConfigMismatchError):
            outcome["differences"] = exc.differences
    else:
        outcome = {"error": None}
        ps.destroy_model_parallel()
    finally:
        agreement.set_agreement_check(*previous)
    outcome["seconds"] = time.monotonic() - start
    outcome["initialized_after"] = ps.is_initialized()
    outcome["state_after"] = ps.get_state()
    outcome["new_live_groups"] = _live_groups() - live
    return outcome


def _skip_call() -> dict:
    return {"error": "skipped", "new_live_groups": 0, "initialized_after": False, "state_after": None}


def _init_unless_rank_3(kwargs: dict) -> dict:
    """Rank 3 never calls initialize_model_parallel; the others do, with a 3 s check timeout."""
    if dist.get_rank() == 3:
        return _skip_call()
    return _init_outcome(kwargs, 3.0)


def _late_init_outcome(kwargs: dict, timeout_s: float, delay_s: float) -> dict:
    time.sleep(delay_s)
    return _init_outcome(kwargs, timeout_s)


def _realign() -> dict:
    return agreement.realign_sequences()


def _check_direct(fields: dict) -> tuple[int, bool, bool]:
    result = check_agreement(fields, name="test-direct", timeout=30)
    return result.store_ops, result.compared, result.skipped


def _grid_outcome(shape: list, names: list) -> dict:
    from parallel_state_ng import HyperCommGrid

    try:
        grid = HyperCommGrid(shape, names, check_agreement=True)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    grid.create_pg(names[0])
    grid.destroy()
    return {"error": None}


def _disabled_check(tp: int, how: str):
    if how == "env":
        old = os.environ.get(agreement.ENV_ENABLE)
        os.environ[agreement.ENV_ENABLE] = "0"
        try:
            return pipeline.agree({"tensor_model_parallel_size": tp}, name="initialize_model_parallel")
        finally:
            if old is None:
                del os.environ[agreement.ENV_ENABLE]
            else:
                os.environ[agreement.ENV_ENABLE] = old
    previous = agreement.set_agreement_check(False)
    try:
        return pipeline.agree({"tensor_model_parallel_size": tp}, name="initialize_model_parallel")
    finally:
        agreement.set_agreement_check(*previous)


# --------------------------------------------------------------------------- helpers
def _assert_clean(outcomes: list[dict]) -> None:
    for rank, out in enumerate(outcomes):
        assert out["initialized_after"] is False, rank
        assert out["state_after"] is None, rank
        assert out["new_live_groups"] == 0, (rank, out)


def _assert_world_works(world) -> None:
    """A correct initialization succeeds on every rank afterwards."""
    outcomes = world.run(_init_outcome, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2})
    assert [o["error"] for o in outcomes] == [None] * world.world_size
    _assert_clean(outcomes)


# --------------------------------------------------------------------------- gloo tests
@pytest.mark.slow
def test_one_rank_with_another_tp_size_fails_on_every_rank(gloo_world):
    world = gloo_world(4)
    args = [({"tensor_model_parallel_size": 1},)] * 3 + [({"tensor_model_parallel_size": 2},)]
    outcomes = world.run_per_rank(_init_outcome, args, timeout=90)
    assert [o["error"] for o in outcomes] == ["ParallelConfigMismatchError"] * 4
    assert len({o["message"] for o in outcomes}) == 1  # the same verdict everywhere
    message = outcomes[0]["message"]
    assert "tensor_model_parallel_size: 1 on ranks 0-2; 2 on rank 3" in message
    assert outcomes[0]["differences"] == {"tensor_model_parallel_size": [1, 2]}
    _assert_clean(outcomes)
    print("mismatch detection seconds by rank:", [round(o["seconds"], 4) for o in outcomes])
    _assert_world_works(world)


def test_an_invalid_value_on_one_rank_is_reported_as_a_mismatch_everywhere(gloo_world):
    # Rank 2 alone would fail validation (4 ranks are not divisible by 3); the others would
    # then wait for it. The check runs first, so every rank learns about the difference.
    world = gloo_world(4)
    args = [({"pipeline_model_parallel_size": 2, "order": "tp-cp-ep-dp-pp"},)] * 4
    args[2] = ({"pipeline_model_parallel_size": 3, "order": "tp-pp-dp"},)
    outcomes = world.run_per_rank(_init_outcome, args, timeout=90)
    assert [o["error"] for o in outcomes] == ["ParallelConfigMismatchError"] * 4
    differences = outcomes[0]["differences"]
    assert differences == {"pipeline_model_parallel_size": [2, 3], "order": ["tp-cp-ep-dp-pp", "tp-pp-dp"]}
    assert "ranks 0-1, 3" in outcomes[1]["message"] and "on rank 2" in outcomes[1]["message"]
    _assert_clean(outcomes)
    _assert_world_works(world)


@pytest.mark.slow
def test_rank_that_never_calls_init_is_named_by_the_others(gloo_world):
    world = gloo_world(4)
    kwargs = {"tensor_model_parallel_size": 2}
    try:
        outcomes = world.run(_init_unless_rank_3, kwargs, timeout=90)
        assert outcomes[3]["error"] == "skipped"
        assert [o["error"] for o in outcomes[:3]] == ["ParallelConfigTimeoutError"] * 3
        assert all(o["missing"] == [3] for o in outcomes[:3])
        assert "rank 3 did not reach the agreement check within 3 s (3 of 4 ranks arrived)" in outcomes[0]["message"]
        _assert_clean(outcomes)
    finally:
        # Rank 3 made one check fewer than the others: bring the sequence numbers together.
        numbers = world.run(_realign)
        assert all(n == numbers[0] for n in numbers)
    _assert_world_works(world)


@pytest.mark.slow
def test_rank_that_arrives_after_the_timeout_gets_the_timeout_error_too(gloo_world):
    world = gloo_world(4)
    kwargs = {"tensor_model_parallel_size": 2}
    args = [(kwargs, 1.0, 0.0)] * 3 + [(kwargs, 1.0, 3.5)]
    outcomes = world.run_per_rank(_late_init_outcome, args, timeout=90)
    assert [o["error"] for o in outcomes] == ["ParallelConfigTimeoutError"] * 4
    assert all(o["missing"] == [3] for o in outcomes)
    assert "this rank arrived after the others gave up waiting for rank 3" in outcomes[3]["message"]
    _assert_clean(outcomes)
    _assert_world_works(world)


def test_store_operations_per_rank_are_constant(gloo_world):
    world = gloo_world(4)
    results = world.run(_check_direct, {"tensor_model_parallel_size": 4, "order": "tp-cp-ep-dp-pp"})
    ops = sorted(r[0] for r in results)
    assert [r[1] for r in results].count(True) == 1  # exactly one rank compared
    assert ops == [5, 5, 5, 5]  # set, set, add, wait, read (the last arrival: set, set, add, multi_get, compare_set)
    assert not any(r[2] for r in results)


def test_hyper_comm_grid_check_agreement(gloo_world):
    world = gloo_world(4)
    outcomes = world.run(_grid_outcome, [2, 2], ["tp", "dp"])
    assert [o["error"] for o in outcomes] == [None] * 4
    args = [([2, 2], ["tp", "dp"])] * 4
    args[1] = ([4], ["tp"])
    outcomes = world.run_per_rank(_grid_outcome, args, timeout=90)
    assert [o["error"] for o in outcomes] == ["ParallelConfigMismatchError"] * 4
    message = outcomes[0]["message"]
    assert message.startswith("HyperCommGrid:")
    assert "shape: [2, 2] on ranks 0, 2-3; [4] on rank 1" in message
    assert 'dim_names: ["tp", "dp"] on ranks 0, 2-3; ["tp"] on rank 1' in message


def _check_in_halves(fields: dict) -> dict:
    """Ranks 0-1 and ranks 2-3 each run their own check (participants given as rank lists)."""
    half = [0, 1] if dist.get_rank() < 2 else [2, 3]
    try:
        result = check_agreement(fields, name="halves", timeout=30, group=half)
    except ParallelConfigMismatchError as exc:
        return {"error": str(exc)}
    return {"error": None, "participants": result.participants}


def test_check_over_a_subset_of_ranks(gloo_world):
    world = gloo_world(4)
    # Ranks 0 and 1 disagree; ranks 2 and 3 agree with each other (on another value).
    outcomes = world.run_per_rank(_check_in_halves, [({"x": 1},), ({"x": 2},), ({"x": 3},), ({"x": 3},)], timeout=90)
    assert outcomes[0] == outcomes[1] and "x: 1 on rank 0; 2 on rank 1" in outcomes[0]["error"]
    assert outcomes[2] == outcomes[3] == {"error": None, "participants": 2}


@pytest.mark.parametrize("how", ["env", "setting"])
def test_turned_off_means_no_communication(gloo_world, how):
    world = gloo_world(4)
    # Different values on every rank and no comparison: each returns at once, nobody waits.
    results = world.run_per_rank(_disabled_check, [(r + 1, how) for r in range(4)], timeout=60)
    assert results == [None] * 4


# --------------------------------------------------------------------------- in-process
def test_fake_backend_skips_and_init_still_works(fake_world):
    import compat.parallel_state as ps

    fake_world(3, 8)
    result = check_agreement({"a": 1}, name="fake", timeout=1)
    assert result.skipped and "fake" in result.reason and result.store_ops == 0
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    try:
        assert ps.get_tensor_model_parallel_world_size() == 2
    finally:
        ps.destroy_model_parallel()


def _threaded_round(n: int, fields_of, timeout: float = 10.0, absent=()):
    """Run the protocol with ``n`` participants as threads on one HashStore."""
    store = dist.HashStore()
    out: dict[int, object] = {}

    def participant(i: int) -> None:
        try:
            out[i] = agreement._run_round(
                dist.PrefixStore("round/", store), i, range(n), fields_of(i), name="threads", timeout=timeout
            )
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=participant, args=(i,)) for i in range(n) if i not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("n", [2, 16, 64])
def test_protocol_cost_does_not_grow_with_participants(n):
    out = _threaded_round(n, lambda i: {"tp": 2, "order": "tp-pp"})
    results = [out[i] for i in range(n)]
    assert all(isinstance(r, tuple) for r in results), results
    assert sorted(r[0] for r in results) == [5] * n  # the last arrival: multi_get + compare_set for wait + get
    assert sum(r[1] for r in results) == 1


def test_protocol_reports_every_distinct_configuration():
    def fields(i: int) -> dict:
        return {"tp": 1 + (i % 3 == 0), "order": "tp-pp", "fn": print if i == 5 else len}

    out = _threaded_round(12, fields)
    errors = [out[i] for i in range(12)]
    assert all(isinstance(e, ParallelConfigMismatchError) for e in errors)
    assert len({str(e) for e in errors}) == 1
    err = errors[0]
    assert err.group_sizes == [7, 4, 1]
    assert err.rank_groups == [[(1, 2), (4, 4), (7, 8), (10, 11)], [(0, 0), (3, 3), (6, 6), (9, 9)], [(5, 5)]]
    assert err.differences["tp"] == [1, 2, 1]
    assert err.differences["fn"] == [
        {"callable": "builtins.len"},
        {"callable": "builtins.len"},
        {"callable": "builtins.print"},
    ]
    assert "order" not in err.differences


def test_protocol_names_several_missing_participants():
    out = _threaded_round(8, lambda i: {"tp": 1}, timeout=0.5, absent=(2, 5, 6))
    for i in (0, 1, 3, 4, 7):
        err = out[i]
        assert isinstance(err, ParallelConfigTimeoutError)
        assert err.missing_rank_list() == [2, 5, 6] and err.arrived == 5 and err.expected == 8
        assert "ranks 2, 5-6 did not reach" in str(err)


def test_canonical_json_is_process_independent_and_type_exact():
    class Thing:
        pass

    a = canonical_json({"b": [1, 2], "a": Thing(), "f": _skip_call, "t": True})
    b = canonical_json({"t": True, "f": _skip_call, "a": Thing(), "b": (1, 2)})
    assert a == b  # key order, list vs tuple, object addresses do not matter
    assert "0x" not in a and "test_agreement_gloo._skip_call" in a
    assert canonical_json({"x": True}) != canonical_json({"x": 1})
    assert canonical_json({"x": 2.0}) != canonical_json({"x": 2})


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, (True, 60.0)),
        ({"PSNG_AGREEMENT_CHECK": "0"}, (False, 60.0)),
        ({"PSNG_AGREEMENT_TIMEOUT": "7.5"}, (True, 7.5)),
    ],
)
def test_settings_from_environment(monkeypatch, env, expected):
    for name in (agreement.ENV_ENABLE, agreement.ENV_TIMEOUT):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert agreement.agreement_check_settings() == expected
    previous = agreement.set_agreement_check(not expected[0], 3)
    try:
        assert agreement.agreement_check_settings() == (not expected[0], 3.0)
    finally:
        agreement.set_agreement_check(*previous)
    assert agreement.agreement_check_settings() == expected


@pytest.mark.parametrize(
    "name, value",
    [("PSNG_AGREEMENT_CHECK", "maybe"), ("PSNG_AGREEMENT_TIMEOUT", "-1"), ("PSNG_AGREEMENT_TIMEOUT", "soon")],
)
def test_bad_environment_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        agreement.agreement_check_settings()
