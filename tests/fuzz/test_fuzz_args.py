"""Fuzz command-line arguments (``layout``, ``topology``) and API arguments (``MegatronLayout``,
``validate_topology``, ``HyperCommGrid`` shapes, ``verify_groups`` sources, ``use_collection``).

Contract: the CLI exits 0 or 2 (one line, no traceback); the API raises its documented types,
never a torch allocation failure or overflow (tests/fuzz/strategies.py for the values).
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallel_state_ng.builders.grid import HyperCommGrid
from parallel_state_ng.builders.verify.sources import read_source
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.topology_spec import ModuleSpec, TopologySpecError, validate_topology
from parallel_state_ng.releases import as_release
from tests.fuzz.cli import run_cli
from tests.fuzz.strategies import HOSTILE_INTS, fuzz_settings, hostile_ints, json_values

pytestmark = pytest.mark.slow  # a time-boxed fuzz run: docs/testing.md

_TORCH_FAILURES = ("DefaultCPUAllocator", "enforce fail", "Overflow when unpacking", "can't allocate")
_LAYOUT_ERRORS = (ValueError, TypeError, AssertionError, RuntimeError, KeyError)

sizes = st.one_of(st.sampled_from([1, 2, 4, 8]), st.sampled_from(HOSTILE_INTS))
size_text = st.one_of(sizes.map(str), st.sampled_from(["", "x", "1e3", "0x10", "9" * 5000, " 2", "-0"]))
orders = st.one_of(st.sampled_from(["tp-cp-ep-dp-pp", "tp-pp-dp", "pp-dp-tp", "tp-tp"]), st.text(max_size=12))


def _no_torch_failure(err: BaseException) -> None:
    assert not any(s in str(err) for s in _TORCH_FAILURES), str(err)[:500]


@fuzz_settings(60)
@given(
    world=st.one_of(st.sampled_from([1, 8, 16, 64, 256]).map(str), size_text),
    options=st.dictionaries(
        st.sampled_from(["--tp", "--pp", "--cp", "--ep", "--etp", "--num-dist-opt-instances", "--rank"]),
        size_text,
        max_size=3,
    ),
    order=st.one_of(st.none(), orders),
    fmt=st.sampled_from(["text", "json", "svg"]),
    extra=st.lists(
        st.sampled_from(["--share", "--full", "--kinds=tp,dp", "--kinds=xx", "--hcp-sizes=2,2"]), max_size=2
    ),
    release=st.sampled_from(["0.13", "0.16", "0.19", "9.9"]),
)
def test_layout_arguments(world: str, options: dict, order: str | None, fmt: str, extra: list, release: str) -> None:
    argv = ["layout", "--world-size", world, "--format", fmt, "--release", release, *extra]
    for option, value in options.items():
        argv += [option, value]
    if order is not None:
        argv.append(f"--order={order}")
    run_cli(argv, (0, 2))


@fuzz_settings(30)
@given(world=size_text, against=st.sampled_from(["0.19", "0.12", "x"]), key=st.sampled_from(["tp", "world-size", "bad"]),
       value=size_text)  # fmt: skip
def test_layout_diff_arguments(world: str, against: str, key: str, value: str) -> None:
    argv = ["layout", "--world-size", world, "--release", "0.16", "--diff", "--against", against]
    run_cli([*argv, "--against-set", f"{key}={value}"], (0, 1, 2))


@fuzz_settings(30)
@given(world=size_text, rank=size_text, kinds=st.sampled_from([None, "tp", "dp", "zz"]))
def test_topology_arguments(world: str, rank: str, kinds: str | None, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("spec") / "spec.json"
    path.write_text('[{"name": "language", "ranks": [0, 8], "tp": 2, "language": true}]')
    argv = ["topology", str(path), "--release", "0.19", "--world-size", world, "--rank", rank]
    run_cli(argv + ([] if kinds is None else ["--kinds", kinds]), (0, 2))


@fuzz_settings(150)
@given(
    world=hostile_ints,
    tp=sizes,
    pp=sizes,
    cp=sizes,
    ep=sizes,
    order=orders,
    release=st.sampled_from(["0.12", "0.16", "0.19"]),
    rank=hostile_ints,
)
def test_megatron_layout(world: int, tp: int, pp: int, cp: int, ep: int, order: str, release: str, rank: int) -> None:
    try:
        layout = MegatronLayout(
            world_size=world,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            order=order,
            release=release,
        )
        if layout.contains(rank):
            layout.group("tp", rank)
    except _LAYOUT_ERRORS as err:
        _no_torch_failure(err)


@fuzz_settings(150)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"name": st.sampled_from(["a", "b", "language", "1x", ""]), "ranks": st.tuples(hostile_ints, hostile_ints)},
            optional={"tensor_model_parallel_size": sizes, "language": st.booleans(), "options": json_values},
        ),
        max_size=4,
    ),
    hostile_ints,
)
def test_validate_topology(modules: list[dict], world: int) -> None:
    specs = [ModuleSpec(**m) for m in modules]
    try:
        validate_topology(specs, world, "0.19")
    except TopologySpecError as err:
        assert "\n" not in str(err)


@fuzz_settings(100)
@given(
    shape=st.lists(st.one_of(hostile_ints, st.sampled_from([1, 2, 4])), max_size=6),
    offset=hostile_ints,
    world=st.sampled_from(["8", "64", str(2**63), "-1", "x"]),
)
def test_hyper_comm_grid_shapes(shape: list[int], offset: int, world: str) -> None:
    names = [f"d{i}" for i in range(len(shape))]
    with mock.patch.dict(os.environ, {"WORLD_SIZE": world}):
        try:
            HyperCommGrid(shape, names, rank_offset=offset)
        except (ValueError, TypeError, RuntimeError) as err:
            _no_torch_failure(err)


@fuzz_settings(60)
@given(source=st.one_of(json_values, st.dictionaries(st.text(max_size=8), json_values, max_size=4)))
def test_verify_sources(source: object) -> None:
    try:
        read_source(source, as_release("0.16"))
    except (TypeError, ValueError) as err:
        _no_torch_failure(err)


@fuzz_settings(30)
@given(json_values)
def test_use_collection_without_world(pgc: object) -> None:
    import compat

    with pytest.raises(TypeError):
        with compat.use_collection(pgc):
            pass
