"""Differential test: ``compat.parallel_state`` against Megatron-Core's ``parallel_state``.

For each configuration (world size 1 ... 1024, every argument of the installed MCore's
``initialize_model_parallel``; configurations in ``tests/support/differential/configs.py``) and several
ranks of it (first, last, a few seeded random ones), in one process on the fake backend: init MCore on rank r, snapshot everything
observable (``tests/support/differential/library.py``), destroy; do the same with compat; the two must match.
A configuration MCore rejects must be rejected by compat with the same exception type (or a
subclass), and compat must be atomic: after its failed init the state is what it was before.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import megatron.core.parallel_state as mcore_ps
import pytest

from tests.support.differential import helper_cases as H
from tests.support.differential import library as D
from tests.support.differential.configs import Config, emb_all, has, has_function
from tests.support.differential.plans import all_configs
from tests.support.differential.run import Tally, compare_config, run_side
from tests.support.differential.run import init_kwargs as _init_kwargs

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

CONFIGS = all_configs()
TALLY = Tally()


def _kwargs(cfg: Config, tmp_path) -> dict[str, Any]:
    return _init_kwargs(cfg, tmp_path)


@pytest.fixture(autouse=True)
def _no_world_left():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def compat_ps():
    """The module under test, ``compat.parallel_state``."""
    import compat.parallel_state

    return compat.parallel_state


# The seeded random part of the sweep is marked slow as a whole (each configuration is quick, the
# ~230 together take ~20 s on one core); the hand-written edge cases stay in the fast set.
SWEEP = [pytest.param(c, id=c.id, marks=() if c.hand_written else pytest.mark.slow) for c in CONFIGS]


@pytest.mark.parametrize("cfg", SWEEP)
def test_compat_matches_mcore(cfg: Config, compat_ps, tmp_path):
    """Every observable of compat equals MCore's, for each compared rank of ``cfg``."""
    failures = compare_config(compat_ps, cfg, tmp_path, TALLY)
    if failures:
        pytest.fail(f"{cfg.id}\n" + "\n\n".join(failures), pytrace=False)


def test_summary_of_differential():
    """Prints 'configurations x ranks compared, mismatches' for this process."""
    if TALLY.runs == 0:
        pytest.skip("no differential configuration ran in this process (another xdist worker ran them)")
    print(
        f"\ndifferential: {TALLY.configs} configurations, {TALLY.runs} configuration x rank runs compared "
        f"({TALLY.valid_runs} valid inits), mismatching configurations: {len(TALLY.mismatches)}"
    )
    for exc, names in sorted(TALLY.mcore_leftovers.items()):
        print(f"  MCore after a failed init ({exc}) leaves set: {sorted(names) or 'nothing'}")
    for cid, (ref_env, got_env) in sorted(TALLY.env_on_failure.items()):
        print(f"  env after failed init {cid}: MCore {ref_env}, compat {got_env}")
    assert TALLY.configs >= 1 and TALLY.runs >= TALLY.configs
    assert not TALLY.mismatches, f"mismatching configurations: {TALLY.mismatches}"


# --------------------------------------------------------------------------- harness self-checks


HARNESS_SAMPLE = [c for c in CONFIGS if c.world in (4, 16, 64)][::6][:8]


@pytest.mark.parametrize("cfg", HARNESS_SAMPLE, ids=[c.id for c in HARNESS_SAMPLE])
def test_harness_is_deterministic_mcore_vs_mcore(cfg: Config, tmp_path):
    """MCore against itself shows no difference: the harness adds no noise of its own."""
    for rank in cfg.ranks()[:2]:
        first = run_side(mcore_ps, cfg, rank, tmp_path)
        second = run_side(mcore_ps, cfg, rank, tmp_path)
        assert D.compare(first.comparable(), second.comparable()) == []


def test_harness_detects_a_swapped_group():
    """A wrong group behind one getter is reported under that getter's key."""
    D.fake_world(5, 8)
    with D.recording():
        mcore_ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
        good = D.snapshot(mcore_ps, 5)
        mcore_ps._TENSOR_MODEL_PARALLEL_GROUP = mcore_ps._DATA_PARALLEL_GROUP
        bad = D.snapshot(mcore_ps, 5)
    mcore_ps.destroy_model_parallel()
    D.reset_mcore()
    keys = [d.key for d in D.compare(good, bad)]
    assert "get_tensor_model_parallel_group()" in keys
    assert "global:_TENSOR_MODEL_PARALLEL_GROUP" in keys
    assert "get_tensor_model_parallel_rank()" in keys


def test_harness_records_each_getters_warnings_under_its_own_key(monkeypatch):
    """A warning one getter emits is recorded under that getter's key only (one warnings block
    spans the whole snapshot), and a filter that ignores the category does not hide it.
    """
    D.fake_world(5, 8)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    original = mcore_ps.get_tensor_model_parallel_world_size

    def warning_getter():
        warnings.warn("old getter", DeprecationWarning, stacklevel=2)
        return original()

    with D.recording():
        mcore_ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
        quiet = D.snapshot(mcore_ps, 5)
        monkeypatch.setattr(mcore_ps, "get_tensor_model_parallel_world_size", warning_getter)
        noisy = D.snapshot(mcore_ps, 5)
        monkeypatch.undo()
    mcore_ps.destroy_model_parallel()
    D.reset_mcore()
    assert [d.key for d in D.compare(quiet, noisy)] == ["warnings:get_tensor_model_parallel_world_size()"]
    assert noisy["warnings:get_tensor_model_parallel_world_size()"] == ("DeprecationWarning",)


def test_harness_detects_a_global_left_after_destroy():
    """A group left in a global after destroy (where MCore resets it) is reported; MCore's own
    leftovers and import-time values are accepted.
    """
    D.fake_world(5, 8)
    cfg = Config(8, {"tensor_model_parallel_size": 2, "create_gloo_process_groups": False})
    ref = D.observe(mcore_ps, 5, cfg.kwargs, setter_phase=False)
    assert D.destroy_differences(ref.after_destroy, ref.after_destroy) == []
    assert D.destroy_differences(ref.after_destroy, D.pristine_globals()) == []
    leaky = dict(ref.after_destroy, **{"global:_TENSOR_MODEL_PARALLEL_GROUP": ("group", (4, 5))})
    assert [d.key for d in D.destroy_differences(ref.after_destroy, leaky)] == ["global:_TENSOR_MODEL_PARALLEL_GROUP"]


def test_harness_refuses_an_unknown_getter(monkeypatch):
    """A new reference getter with a parameter the snapshot cannot fill fails loudly."""

    def get_brand_new_group(some_new_flag=False):
        return None

    get_brand_new_group.__module__ = mcore_ps.__name__
    monkeypatch.setattr(mcore_ps, "get_brand_new_group", get_brand_new_group, raising=False)
    D.getter_calls.cache_clear()
    try:
        with pytest.raises(D.UnknownApiError, match="some_new_flag"):
            D.getter_calls(8)
    finally:
        monkeypatch.undo()
        D.getter_calls.cache_clear()


def test_harness_refuses_an_unknown_public_function(monkeypatch):
    """A new reference function that is neither getter nor setter nor listed fails loudly."""

    def rebuild_everything():
        return None

    rebuild_everything.__module__ = mcore_ps.__name__
    monkeypatch.setattr(mcore_ps, "rebuild_everything", rebuild_everything, raising=False)
    with pytest.raises(D.UnknownApiError, match="rebuild_everything"):
        D.classify_functions()


# --------------------------------------------------------------------------- uninitialized state

UNINIT_CONFIGS = [
    Config(
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
            "hierarchical_context_parallel_sizes": [2],
            "virtual_pipeline_model_parallel_size": 2,
            "create_gloo_process_groups": False,
        },
    ),
    Config(
        16,
        {
            "context_parallel_size": 2,
            "num_distributed_optimizer_instances": 2,
            "expert_model_parallel_size": 2,
            "create_gloo_process_groups": False,
            # the options the reference has: hybrid groups (0.16+), the all-gather group in init
            # (0.16-0.17) or after it (0.18+)
            **({"hybrid_context_parallel": True} if has("hybrid_context_parallel") else {}),
            **({"create_all_gather_group": True} if has("create_all_gather_group") else {}),
        },
        after_init=(
            (D.Call("create_all_gather_groups", {"for_expert_parallelism": True}),)
            if has_function("create_all_gather_groups")
            else ()
        ),
    ),
    Config(8, {"pipeline_model_parallel_size": 4, "get_embedding_ranks": emb_all, "create_gloo_process_groups": False}),
]


def test_uninitialized_without_a_world(compat_ps):
    """Before any init and without a default process group, compat answers like MCore."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    D.reset_mcore()
    compat_ps.destroy_model_parallel()
    diffs = D.compare(D.snapshot_uninitialized(mcore_ps), D.snapshot_uninitialized(compat_ps))
    assert not diffs, D.describe(diffs)


@pytest.mark.parametrize("world,rank", [(1, 0), (8, 3), (64, 63)])
def test_uninitialized_in_a_world(compat_ps, world, rank):
    """Before any init, in a fake world, compat answers like MCore."""
    D.fake_world(rank, world)
    D.reset_mcore()
    compat_ps.destroy_model_parallel()
    diffs = D.compare(D.snapshot_uninitialized(mcore_ps), D.snapshot_uninitialized(compat_ps))
    assert not diffs, D.describe(diffs)


def _after_destroy(ps, cfg: Config, rank: int, tmp_path) -> dict[str, Any]:
    D.fake_world(rank, cfg.world)
    D.forget_recorded_groups()
    with D.recording():
        ps.initialize_model_parallel(**_kwargs(cfg, tmp_path))
        for call in cfg.after_init:
            getattr(ps, call.name)(**call.kwargs)
    ps.destroy_model_parallel()
    snap = D.snapshot_uninitialized(ps)
    D.forget_recorded_groups()
    return snap


@pytest.mark.parametrize("cfg", UNINIT_CONFIGS, ids=[c.id for c in UNINIT_CONFIGS])
def test_uninitialized_after_destroy(compat_ps, cfg: Config, tmp_path):
    """After destroy, each key of compat equals MCore's value after destroy or MCore's pristine value.

    MCore's destroy_model_parallel leaves some globals set (they are listed in the output);
    compat may either do the same or reset them, but nothing else may differ.
    """
    rank = cfg.world - 1
    D.fake_world(rank, cfg.world)
    D.reset_mcore()
    pristine = D.snapshot_uninitialized(mcore_ps)
    mcore_after = _after_destroy(mcore_ps, cfg, rank, tmp_path)
    D.reset_mcore()
    compat_after = _after_destroy(compat_ps, cfg, rank, tmp_path)
    mcore_leaks = [d.key for d in D.compare(pristine, mcore_after)]
    bad = [d for d in D.compare(mcore_after, compat_after) if not D.equivalent(pristine.get(d.key, D.ABSENT), d.other)]
    compat_leaks = [k for k in mcore_leaks if D.equivalent(mcore_after.get(k), compat_after.get(k, D.ABSENT))]
    print(f"\nMCore leaks after destroy: {mcore_leaks}\ncompat leaks the same: {compat_leaks}")
    assert not bad, D.describe(bad)


# --------------------------------------------------------------------------- failed and repeated inits

INVALID_THEN_VALID = [c for c in CONFIGS if c.invalid]


def _valid_kwargs(world: int) -> dict[str, Any]:
    sizes = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2} if world % 4 == 0 else {}
    return {**sizes, "create_gloo_process_groups": False}


@pytest.mark.parametrize("cfg", INVALID_THEN_VALID, ids=[c.id for c in INVALID_THEN_VALID])
def test_valid_init_after_failed_init(compat_ps, cfg: Config, tmp_path):
    """After a failed compat init (no destroy), a correct init works and matches MCore's."""
    rank = cfg.world - 1
    D.fake_world(rank, cfg.world)
    D.reset_mcore()
    expected = D.observe(mcore_ps, rank, _valid_kwargs(cfg.world))
    D.fake_world(rank, cfg.world)
    with D.preserved_environment():
        os.environ.update(cfg.env)
        failed, _ = D._call(lambda: compat_ps.initialize_model_parallel(**_kwargs(cfg, tmp_path)), {})
    if not isinstance(failed, Exception):
        compat_ps.destroy_model_parallel()
        pytest.skip(f"compat accepts {cfg.id} (reported by test_compat_matches_mcore if MCore does not)")
    got = D.observe(compat_ps, rank, _valid_kwargs(cfg.world))
    # MCore, for the record: a valid init after a failed one
    D.fake_world(rank, cfg.world)
    with D.preserved_environment():
        os.environ.update(cfg.env)
        D._call(lambda: mcore_ps.initialize_model_parallel(**_kwargs(cfg, tmp_path)), {})
        mcore_second, _ = D._call(lambda: mcore_ps.initialize_model_parallel(**_valid_kwargs(cfg.world)), {})
    mcore_ps.destroy_model_parallel()
    D.reset_mcore()
    verdict = type(mcore_second).__name__ if isinstance(mcore_second, Exception) else "ok"
    print(f"\nMCore: valid init after failed {cfg.id}: {verdict}")
    diffs = D.compare(expected.comparable(), got.comparable())
    assert not diffs, D.describe(diffs)


SECOND_INITS = [
    ({"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 2}),
    (
        {"pipeline_model_parallel_size": 2},
        {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2},
    ),
    ({"context_parallel_size": 2}, {"context_parallel_size": 2, "hybrid_context_parallel": True}),
    ({}, {"tensor_model_parallel_size": 3}),
]


@pytest.mark.parametrize("first,second", SECOND_INITS, ids=[f"second{i}" for i in range(len(SECOND_INITS))])
def test_second_init_without_destroy(compat_ps, first, second):
    """A second init without destroy raises the same type in both; compat's state is unchanged."""
    rank, world = 6, 8
    outcomes, changes = {}, {}
    for name, ps in (("mcore", mcore_ps), ("compat", compat_ps)):
        D.fake_world(rank, world)
        D.forget_recorded_groups()
        with D.recording():
            ps.initialize_model_parallel(create_gloo_process_groups=False, **first)
            before = D.snapshot(ps, rank)
            result, _ = D._call(lambda: ps.initialize_model_parallel(create_gloo_process_groups=False, **second), {})
            after = D.snapshot(ps, rank)
        ps.destroy_model_parallel()
        if ps is mcore_ps:
            D.reset_mcore()
        D.forget_recorded_groups()
        outcomes[name] = D.raised(result) if isinstance(result, Exception) else "ok"
        changes[name] = D.compare(before, after)
    print(f"\nMCore second init {second}: {outcomes['mcore'][:2]}, changed {[d.key for d in changes['mcore']]}")
    assert D.equivalent(outcomes["mcore"], outcomes["compat"]), outcomes
    assert not changes["compat"], D.describe(changes["compat"])


# --------------------------------------------------------------------------- public helpers


@pytest.mark.parametrize("case", H.rank_generator_cases(), ids=H.case_id)
def test_rank_generator_matches(compat_ps, case):
    """``RankGenerator``: attributes, ``get_ranks`` and ``get_mask`` for every token combination."""
    problems = H.compare_rank_generator(compat_ps, case)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", H.helper_cases())
def test_public_helper_matches(compat_ps, case):
    """Public helpers give MCore's results: values, groups (ranks, desc, timeout), global list."""
    problems = H.compare_helper(compat_ps, case)
    assert not problems, "\n".join(problems)
