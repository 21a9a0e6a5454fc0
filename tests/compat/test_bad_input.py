"""Bad input to ``compat.parallel_state.initialize_model_parallel``: a table over every argument.

Each case must raise at once (each test runs under an alarm, on the fake backend, world of 8),
with a message naming the argument, leave nothing behind (not initialized, every module
global back to None / empty, no new process group) and let a correct call succeed next.
Where megatron-core raises for the same input, our exception must be an instance of its type
(megatron-core is run on the same input in the same test).
"""

from __future__ import annotations

import collections
import inspect
import math
import signal
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch.distributed as dist

import compat
import compat.parallel_state as ps
from parallel_state_ng.releases import Release
from tests.support.pristine import pristine_problems

WORLD = 8
RANK = 3
ALARM_S = 30

SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "num_distributed_optimizer_instances",
    "expert_tensor_parallel_size",
    "virtual_pipeline_model_parallel_size",
)


@dataclass(frozen=True)
class BadInput:
    """One bad input: ``kwargs`` for initialize_model_parallel, the argument it is about, and,
    where megatron-core fails for a reason other than the value itself (or must not be run on
    it), why its exception type is not compared.
    """

    case_id: str
    argument: str
    kwargs: dict
    mcore_fails_for_other_reason: str | None = None
    run_mcore: bool = True
    # Bad only from this release series on: an older release accepts it and builds a layout from
    # it (0.12 builds the hierarchical context-parallel levels that fit), which compat then builds
    # too (the differential test compares them), so there it is no bad input.
    first_series: str | None = None


NEEDS_CUDA = "MCore's SHARP path needs CUDA; on this CPU-only build it fails for that, not for the value"
# MCore passes the int to open(): it reads file descriptor 5 as YAML and closes it. Under pytest
# that descriptor is an output capture file, so MCore is not run on this input at all.
FILE_DESCRIPTOR = "MCore opens file descriptor 5 (and closes it): the outcome depends on the process"


def _ranks_outside_pipeline(pp_ranks, *args):
    return [pp_ranks[0], WORLD + 100]


def _build_cases(parameters: set | None = None, release: Release | None = None) -> list[BadInput]:
    """Every bad input, for the ``initialize_model_parallel`` parameters given (default: compat's)
    of ``release`` (default: the one compat serves).

    A case is kept when the release has every argument it passes (0.14 has no
    ``hybrid_context_parallel``, 0.17+ adds ``rank_offset`` / ``local_world_size``, 0.19 the
    GTP sizes, only 0.12/0.13 have the encoder sizes and the pipeline split rank, ...).
    """
    if parameters is None:
        parameters = set(inspect.signature(ps.initialize_model_parallel).parameters)
    if release is None:
        release = ps.MEGATRON_RELEASE
    cases: list[BadInput] = []

    def add(
        argument: str, label: str, kwargs: dict, other_reason: str | None = None, first_series: str | None = None
    ) -> None:
        run_mcore = other_reason is not FILE_DESCRIPTOR
        cases.append(BadInput(f"{argument}:{label}", argument, kwargs, other_reason, run_mcore, first_series))

    for name in SIZES:
        # vpp needs pp > 1 to be meaningful; give it that so the value itself is what is wrong
        base = {"pipeline_model_parallel_size": 2} if name == "virtual_pipeline_model_parallel_size" else {}
        for label, value in [
            ("str", "2"),
            ("zero", 0),
            ("negative", -2),
            ("bool", True),
            ("float", 2.0),
            ("list", [2]),
        ]:
            add(name, label, {**base, name: value})
        if name != "virtual_pipeline_model_parallel_size":  # any positive vpp is valid
            add(name, "huge", {name: 2**40})
            add(name, "not_divisible", {name: 3})
        if name not in ("expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size"):  # None allowed there
            add(name, "none", {name: None})
    add("virtual_pipeline_model_parallel_size", "without_pipeline", {"virtual_pipeline_model_parallel_size": 2})
    add(
        "num_distributed_optimizer_instances",
        "not_dividing_data_parallel",
        {"tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 8},
    )

    add("pipeline_model_parallel_comm_backend", "int", {"pipeline_model_parallel_comm_backend": 5})
    add("pipeline_model_parallel_comm_backend", "unknown", {"pipeline_model_parallel_comm_backend": "mpi"})

    for name in ("use_sharp", "hybrid_context_parallel", "create_gloo_process_groups"):
        # a truthy create_gloo_process_groups makes MCore create gloo groups: the simulated world's
        # stand-ins serve them (parallel_state_ng.testing.simulated), so MCore accepts "yes" and 1
        reason = {"use_sharp": NEEDS_CUDA}.get(name)
        add(name, "str", {name: "yes"}, reason)
        add(name, "int", {name: 1}, reason)
        add(name, "none", {name: None})
    add(
        "hybrid_context_parallel",
        "odd_data_context_parallel",
        {"hybrid_context_parallel": True, "tensor_model_parallel_size": 8},
    )
    add("create_all_gather_group", "str", {"create_all_gather_group": "yes"})
    add("create_all_gather_group", "int", {"create_all_gather_group": 1})

    hcp = "hierarchical_context_parallel_sizes"
    for label, value in [
        ("str", "2,2"),
        ("int", 4),
        ("zero_item", [0, 2]),
        ("negative_items", [-2, -2]),
        ("float_items", [2.0, 2.0]),
        ("bool_item", [True, 4]),
        ("none_item", [None, 4]),
        ("wrong_product", [2, 3]),
        ("huge_item", [2**40]),
    ]:
        # 0.12 does not check the product: it builds the levels that fit in cp
        first = "0.13" if label in ("wrong_product", "huge_item") else None
        add(hcp, label, {"context_parallel_size": 4, hcp: value}, first_series=first)

    path = "nccl_communicator_config_path"
    add(path, "int", {path: 5}, FILE_DESCRIPTOR)
    add(path, "missing_file", {path: "/nonexistent/psng-nccl-config.yaml"})

    minutes = "distributed_timeout_minutes"
    for label, value in [
        ("str", "30"),
        ("zero", 0),
        ("negative", -5),
        ("bool", True),
        ("none", None),
        ("nan", math.nan),
        ("inf", math.inf),
        ("huge", 2**50),
    ]:
        add(minutes, label, {minutes: value})

    for label, value in [
        ("int", 5),
        ("none", None),
        ("list", ["tp", "dp"]),
        ("empty", ""),
        ("unknown_token", "tp-xx-dp-pp"),
        ("unknown_token_upper_case", "TP-CP-EP-DP-PP-ZZ"),
        ("duplicated_token", "tp-tp-cp-ep-dp-pp"),
    ]:
        add("order", label, {"order": value})
    add("order", "missing_token_of_size_2", {"order": "cp-ep-dp-pp", "tensor_model_parallel_size": 2})

    for name in ("get_embedding_ranks", "get_position_embedding_ranks"):
        add(name, "not_callable", {name: 5, "pipeline_model_parallel_size": 2})
        add(name, "ranks_outside_pipeline", {name: _ranks_outside_pipeline, "pipeline_model_parallel_size": 2})

    streams = "high_priority_stream_groups"
    add(streams, "str", {streams: "tp"})
    add(streams, "int", {streams: 5})
    add(streams, "int_item", {streams: [5]})

    sharp = "sharp_enabled_group"
    add(sharp, "without_use_sharp", {sharp: "dp"})
    add(sharp, "unknown", {"use_sharp": True, sharp: "tp"})
    add(sharp, "int", {"use_sharp": True, sharp: 5})
    add(sharp, "dp_replica_with_one_instance", {"use_sharp": True, sharp: "dp_replica"})

    # 0.19: the GTP weight-rematerialization sizes
    for name in ("gtp_remat_size", "expert_gtp_remat_size"):
        base = {"expert_model_parallel_size": 2} if name == "expert_gtp_remat_size" else {}
        for label, value in [
            ("str", "2"),
            ("zero", 0),
            ("negative", -2),
            ("bool", True),
            ("float", 2.0),
            ("list", [2]),
            ("none", None),
            ("huge", 2**40),
            ("not_divisible", 3),
        ]:
            add(name, label, {**base, name: value})
        add(name, "with_two_optimizer_instances", {**base, name: 2, "num_distributed_optimizer_instances": 2})
    # 0.17+: a layout on part of the world
    for label, value in [("str", "2"), ("negative", -1), ("bool", True), ("float", 2.0), ("none", None), ("list", [2])]:
        add("rank_offset", label, {"rank_offset": value, "local_world_size": 4})
    add("rank_offset", "layout_beyond_world", {"rank_offset": 6, "local_world_size": 4})
    add("rank_offset", "without_local_world_size", {"rank_offset": 4})
    for label, value in [
        ("str", "4"),
        ("zero", 0),
        ("negative", -4),
        ("bool", True),
        ("float", 4.0),
        ("list", [4]),
        ("beyond_world", 16),
    ]:
        add("local_world_size", label, {"local_world_size": value})
    add("local_world_size", "not_divisible", {"local_world_size": 3, "tensor_model_parallel_size": 2})
    # 0.12/0.13: encoder sizes (an encoder block needs encoder pp > 0) and the pipeline split rank
    enc_tp, enc_pp = "encoder_tensor_model_parallel_size", "encoder_pipeline_model_parallel_size"
    for label, value in [("str", "1"), ("bool", True), ("float", 1.0), ("list", [1]), ("huge", 2**40)]:
        add(enc_tp, label, {enc_tp: value, enc_pp: 1})
    add(enc_tp, "negative", {enc_tp: -1})  # MCore: no encoder block, accepted
    add(enc_tp, "negative_with_encoder", {enc_tp: -1, enc_pp: 1, "tensor_model_parallel_size": 2})
    add(enc_tp, "none", {enc_tp: None})
    add(enc_tp, "greater_than_tp", {enc_tp: 2})
    for label, value in [
        ("str", "1"),
        ("negative", -1),
        ("bool", True),
        ("float", 1.0),
        ("list", [1]),
        ("huge", 2**40),
    ]:
        add(enc_pp, label, {enc_pp: value})
    add(enc_pp, "not_divisible", {enc_pp: 1, enc_tp: 1, "tensor_model_parallel_size": 2})
    split = "pipeline_model_parallel_split_rank"
    for label, value in [
        ("str", "1"),
        ("bool", True),
        ("float", 1.0),
        ("list", [1]),
        ("beyond_pipeline", 2),
        ("negative_beyond_pipeline", -3),
    ]:
        add(split, label, {split: value, "pipeline_model_parallel_size": 2})
    add(split, "str_one_stage", {split: "0"})
    return [
        case
        for case in cases
        if set(case.kwargs) <= parameters and (case.first_series is None or release.at_least(case.first_series))
    ]


CASES = _build_cases()


# --------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _alarm():
    """Fail a case that takes more than ALARM_S seconds instead of hanging the run."""

    def expire(signum, frame):
        raise TimeoutError(f"case did not finish within {ALARM_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(ALARM_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def megatron_ps():
    """megatron-core's own parallel_state (with compat.install() undone, if it was in effect)."""
    was_installed = compat.is_installed()
    if was_installed:
        compat.uninstall()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
    assert parallel_state is not ps and parallel_state.__name__ == "megatron.core.parallel_state"
    yield parallel_state
    if was_installed:
        compat.install()


def _builtin_type(exc_type: type) -> type:
    """The nearest builtin exception class (numpy's UFuncTypeError -> TypeError)."""
    return next(t for t in exc_type.__mro__ if t.__module__ == "builtins")


def _clear_einops_caches() -> None:
    """Forget einops' cached recipes.

    MCore's hierarchical groups go through einops, which caches a recipe per (pattern, axis
    lengths); a float length (``[2.0, 2.0]``) hashes like the int, so after MCore failed on it
    every later call with the equal ints fails too, in this whole process. Other tests run
    MCore after this file under pytest-xdist, so the poisoned entries must not outlive a case.
    """
    try:
        import einops.einops as einops_impl
    except ImportError:
        return
    for value in vars(einops_impl).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _mcore_outcome(megatron_ps, kwargs: dict) -> BaseException | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            megatron_ps.initialize_model_parallel(**kwargs)
        except Exception as exc:
            return exc
        finally:
            megatron_ps.destroy_model_parallel()
            _clear_einops_caches()
    return None


# --------------------------------------------------------------------------- tests
def test_every_argument_has_bad_inputs():
    parameters = set(inspect.signature(ps.initialize_model_parallel).parameters)
    covered = {case.argument for case in CASES}
    assert covered == parameters, parameters ^ covered
    assert len({case.case_id for case in CASES}) == len(CASES)
    per_argument = collections.Counter(case.argument for case in CASES)
    assert min(per_argument.values()) >= 2, per_argument  # each argument: at least two bad values


@pytest.mark.parametrize("case", CASES, ids=[c.case_id for c in CASES])
def test_bad_input(case: BadInput, fake_world, megatron_ps):
    kwargs: dict[str, Any] = {"create_gloo_process_groups": False, **case.kwargs}
    fake_world(RANK, WORLD)
    pg_before = set(dist.distributed_c10d._world.pg_map)

    with pytest.raises(Exception) as info:
        ps.initialize_model_parallel(**kwargs)
    ours = info.value
    assert case.argument in str(ours), f"{type(ours).__name__}: {ours}"
    assert pristine_problems(pg_before) == []

    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    assert ps.get_tensor_model_parallel_world_size() == 2
    ps.destroy_model_parallel()
    assert pristine_problems(pg_before) == []

    if not case.run_mcore:
        return
    # megatron-core on the same input, on a fresh world (its failures leave groups behind).
    fake_world(RANK, WORLD)
    theirs = _mcore_outcome(megatron_ps, kwargs)
    if theirs is not None and case.mcore_fails_for_other_reason is None:
        expected = _builtin_type(type(theirs))
        assert isinstance(ours, expected), (
            f"megatron-core raises {type(theirs).__name__} ({theirs}); we raise {type(ours).__name__} ({ours})"
        )
