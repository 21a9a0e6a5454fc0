"""No-globals scopes: compat's global getters refuse to answer while new-code modules run.

Fake backend. A legacy grid is set up with ``initialize_model_parallel`` next to a module built
with ``build_megatron_groups``. Inside ``groups.scope()`` / ``no_globals()`` every served
function that reads or writes a grid raises ``GlobalStateRefusedError`` naming itself and the
scope, the initialization probes answer "not initialized", grid-free functions work; outside,
everything observable (``tests/support/differential/library.py``'s snapshot) is what it was, also after
an exception and out-of-order exits. Megatron's own functions that read a getter (installed
with ``compat.install()``) raise inside the scope instead of answering for the legacy grid.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch.distributed as dist

import compat
import compat.parallel_state as ps
from compat._surface import guard_of
from parallel_state_ng import GlobalStateRefusedError, build_megatron_groups, no_globals
from parallel_state_ng.builders import scope as scope_mod
from parallel_state_ng.releases import SUPPORTED_SERIES, new_code_path
from parallel_state_ng.releases import parallel_state as api
from tests.support.served import has_collection, skip_unless

LEGACY = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "create_gloo_process_groups": False}


@pytest.fixture
def two_modules(fake_world):
    """Rank 5 of 8: the legacy grid (tp 2 pp 2) in the globals, a new module (tp 4 pp 2) with none."""
    fake_world(5, 8)
    ps.initialize_model_parallel(**LEGACY)
    groups = build_megatron_groups(tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    try:
        yield groups
    finally:
        groups.destroy()
        ps.destroy_model_parallel()
        assert not scope_mod._STACK, "a test left a scope entered"


def _served() -> dict[str, object]:
    return {name: getattr(ps, name) for name in api.functions(ps.MEGATRON_RELEASE)}


def _call_anyhow(fn) -> object:
    """Call ``fn`` with ``None`` for each required parameter (the scope check comes first)."""
    required = [p for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]
    return fn(*[None] * len(required))


def _snap():
    from tests.support.differential import library as D

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return D.snapshot(ps, dist.get_rank())


def _same(reference, other, what):
    from tests.support.differential import library as D

    diffs = D.compare(reference, other)
    assert not diffs, f"{what}:\n{D.describe(diffs)}"


def test_release_data_names_real_functions():
    every = {name for series in SUPPORTED_SERIES for name in api.functions(series)}
    assert new_code_path.GRID_FREE_FUNCTIONS <= every, new_code_path.GRID_FREE_FUNCTIONS - every
    assert set(new_code_path.INITIALIZATION_PROBES) <= every
    assert not new_code_path.GRID_FREE_FUNCTIONS & set(new_code_path.INITIALIZATION_PROBES)
    # the symmetric buffer is built over a grid's tp group: it must refuse
    assert guard_of("get_global_symmetric_memory_buffer") == "refuse"


def test_every_grid_function_refuses_naming_itself_and_the_scope(two_modules):
    refused = []
    with two_modules.scope():
        line = inspect.currentframe().f_lineno - 1
        for name, fn in _served().items():
            if guard_of(name) != "refuse":
                continue
            with pytest.raises(GlobalStateRefusedError) as err:
                _call_anyhow(fn)
            message = str(err.value)
            assert f"parallel_state.{name}()" in message
            assert "MegatronGroups(ranks 0..7, tp=4, pp=2" in message
            assert f"{__file__}:{line}" in message
            refused.append(name)
    assert {"get_tensor_model_parallel_group", "get_data_parallel_rank", "initialize_model_parallel"} <= set(refused)
    assert "destroy_model_parallel" in refused and "set_tensor_model_parallel_rank" in refused
    assert len(refused) >= 60  # the grid functions of the release (fewest in 0.12)
    # nothing was changed by the refused setters / init / destroy
    assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_pipeline_model_parallel_world_size() == 2


def test_refused_error_is_not_an_assertion_error():
    """Code that falls back on 'not initialized' (AssertionError) must not swallow a refusal."""
    assert not issubclass(GlobalStateRefusedError, AssertionError)
    assert issubclass(GlobalStateRefusedError, RuntimeError)


def test_probes_answer_not_initialized_inside_and_grid_free_functions_work(two_modules):
    buffer = ps.get_global_memory_buffer()
    probes = {n: f for n, f in _served().items() if guard_of(n) is not None and guard_of(n) != "refuse"}
    assert "model_parallel_is_initialized" in probes
    outside = {n: f() for n, f in probes.items()}
    with two_modules.scope():
        inside = {n: f() for n, f in probes.items()}
        assert ps.get_global_memory_buffer() is buffer
        assert ps.default_embedding_ranks([0, 4]) == [0, 4]
        assert ps.RankGenerator(2, 1, 1, 4, 1, "tp-cp-ep-dp-pp").get_ranks("tp")[0] == [0, 1]
    assert inside == {n: new_code_path.INITIALIZATION_PROBES[n] for n in probes}
    assert outside == {n: not v for n, v in inside.items()}


def test_outside_the_scope_everything_is_as_before(two_modules):
    before = _snap()
    with two_modules.scope():
        pass
    _same(before, _snap(), "after a scope")
    with pytest.raises(ZeroDivisionError), no_globals("failing block"):
        raise ZeroDivisionError
    _same(before, _snap(), "after a scope left by an exception")
    assert scope_mod.refusing_scope() is None and not scope_mod.REFUSING


def test_use_state_reopens_a_grid_inside_and_scopes_nest(two_modules):
    legacy = ps.get_state()
    with two_modules.scope():
        with ps.use_state(legacy):
            assert ps.get_tensor_model_parallel_world_size() == 2
            with no_globals("inner new module"):
                with pytest.raises(GlobalStateRefusedError, match="inner new module"):
                    ps.get_tensor_model_parallel_rank()
            assert ps.get_pipeline_model_parallel_rank() == 1
        with pytest.raises(GlobalStateRefusedError, match="MegatronGroups"):
            ps.get_tensor_model_parallel_rank()
        with pytest.raises(KeyError), ps.use_state(legacy):  # exception inside use_state
            raise KeyError("x")
        with pytest.raises(GlobalStateRefusedError):
            ps.get_tensor_model_parallel_rank()
    assert ps.get_tensor_model_parallel_rank() == 1


def test_scope_left_out_of_order_takes_inner_scopes_with_it():
    outer = no_globals("outer")
    inner = scope_mod.allow_globals("inner")
    outer.__enter__()
    inner.__enter__()
    assert scope_mod.refusing_scope() is None
    outer.__exit__(None, None, None)  # leaves outer and the inner scope entered after it
    assert not scope_mod._STACK and scope_mod.refusing_scope() is None


def test_compat_no_globals_and_bad_owner():
    with compat.no_globals("compat scope") as entered:
        assert entered.refuses and entered.owner == "compat scope"
        assert entered.where.startswith(__file__)
        assert scope_mod.refusing_scope() is entered
    with pytest.raises(ValueError, match="owner"):
        no_globals("")


def test_scope_of_destroyed_groups_raises(fake_world):
    fake_world(0, 4)
    groups = build_megatron_groups(tensor_model_parallel_size=2)
    groups.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        groups.scope()


@pytest.fixture
def installed(two_modules):
    """``two_modules`` with compat installed (Megatron's own modules read compat's getters)."""
    pytest.importorskip("megatron.core.parallel_state")
    assert not compat.is_installed(), "a previous test left compat installed"
    compat.install()
    try:
        yield two_modules
    finally:
        compat.uninstall()


def test_megatron_functions_reading_a_getter_raise_inside_instead_of_answering(installed):
    """The silent path is closed: outside, Megatron answers for the legacy grid; inside, it raises."""
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    from megatron.core import utils
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.process_groups_config import ProcessGroupCollection

    legacy_tp = dist.get_process_group_ranks(ProcessGroupCollection.use_mpu_process_groups().tp)
    assert legacy_tp == [4, 5]  # the legacy grid's, whoever asks
    assert schedules.get_forward_backward_func() is schedules.forward_backward_pipelining_without_interleaving
    assert utils.get_tensor_model_parallel_group_if_none(None) is ps.get_tensor_model_parallel_group()
    mine = installed.collection()
    with installed.scope():
        with pytest.raises(GlobalStateRefusedError, match=r"parallel_state\.get_\w+_groups?\(\) was called inside"):
            ProcessGroupCollection.use_mpu_process_groups()
        with pytest.raises(GlobalStateRefusedError, match="get_pipeline_model_parallel_world_size"):
            schedules.get_forward_backward_func()
        # Megatron's pg_collection path asks is_initialized() first: inside, it sees a job without
        # globals, passes the module's own group through and never gets the legacy group
        assert utils.get_tensor_model_parallel_group_if_none(mine.tp) is mine.tp
        if _tp_helper_passes_none_through():
            assert utils.get_tensor_model_parallel_group_if_none(None) is None
        else:  # the release's helper asks the global getter for the group: refused inside
            with pytest.raises(GlobalStateRefusedError, match="get_tensor_model_parallel_group"):
                utils.get_tensor_model_parallel_group_if_none(None)
        assert dist.get_process_group_ranks(mine.tp) == [4, 5, 6, 7]


def _tp_helper_passes_none_through() -> bool:
    """Whether the release's ``utils.get_tensor_model_parallel_group_if_none`` hands the group back
    unchanged while ``parallel_state`` is not initialized (0.16 on: read in its source); before,
    a ``None`` group sends it to the global getter (0.12 has no such helper).
    """
    from megatron.core import utils

    helper = getattr(utils, "get_tensor_model_parallel_group_if_none", None)
    if helper is None:  # 0.12: no helper, the mappings read the global getters
        return False
    source = inspect.getsource(helper)
    return "parallel_state.is_initialized()" in source


def test_megatron_reaches_compat_getters_from_bound_names_too(installed):
    """Names bound by ``from megatron.core.parallel_state import ...`` are guarded as well.

    ``model_parallel_cuda_manual_seed`` seeds the tensor-parallel RNG from the global tp rank:
    outside the scope it would seed the new module with the legacy grid's rank.
    """
    import torch
    from megatron.core.tensor_parallel import mappings, random

    assert random.get_tensor_model_parallel_rank is ps.get_tensor_model_parallel_rank
    with installed.scope():
        with pytest.raises(GlobalStateRefusedError, match="get_tensor_model_parallel_rank"):
            random.model_parallel_cuda_manual_seed(1234)
        # a mapping without its group fails loudly (Megatron's own check, or before 0.16 the
        # refused global getter its helper asks; 0.12's mappings ask the getters themselves),
        # with it it runs
        if _tp_helper_passes_none_through():
            refused: tuple[type[BaseException], str] = (AssertionError, "group should not be None")
        else:
            refused = (GlobalStateRefusedError, "get_tensor_model_parallel_(group|world_size)")
        with pytest.raises(refused[0], match=refused[1]):
            mappings.reduce_from_tensor_model_parallel_region(torch.ones(2))
        if "group" in inspect.signature(mappings.reduce_from_tensor_model_parallel_region).parameters:  # 0.13 on
            out = mappings.reduce_from_tensor_model_parallel_region(torch.ones(2), group=installed.group("tp"))
            assert out.shape == (2,)
