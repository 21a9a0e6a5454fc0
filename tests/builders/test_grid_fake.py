"""HyperCommGrid process groups on simulated ranks (torch's fake backend), and bad input.

One rank of a large simulated world is initialized at a time. ``torch.distributed.new_group``
is wrapped to count calls, so each test sees exactly which groups the grid asked torch for.
Expected groups come from megatron's own ``HyperCommGrid.get_rank_enum``.
"""

from __future__ import annotations

import datetime
import functools
import itertools

import pytest
import torch.distributed as dist

from parallel_state_ng import HyperCommGrid, UnknownDimError
from tests.support.releases.grid_checks import rank_enum

megatron_hcg = pytest.importorskip("megatron.core.hyper_comm_grid")
MegatronGrid = megatron_hcg.HyperCommGrid


@pytest.fixture
def new_group_calls(monkeypatch):
    """List of the kwargs of every ``torch.distributed.new_group`` call made during the test."""
    calls: list[dict] = []
    original = dist.new_group

    def recording_new_group(*args, **kwargs):
        bound = dict(zip(["ranks", "timeout", "backend", "pg_options"], args))
        bound.update(kwargs)
        calls.append(bound)
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    return calls


def _megatron_row(shape, names, offset, dims, rank) -> list[int]:
    """The group containing ``rank`` in megatron's enumeration over ``dims``."""
    rows = rank_enum(MegatronGrid(shape, names, rank_offset=offset), dims)
    (row,) = [row for row in rows if rank in row]
    return row


DENSE = ([8, 4, 8, 4], ["tp", "cp", "dp", "pp"])  # 1024 ranks
CASES = [
    # (world, shape, names, offset, rank, dims)
    (1024, *DENSE, 0, 0, "tp"),
    (1024, *DENSE, 0, 517, ["dp", "cp"]),
    (1024, *DENSE, 0, 1023, ["pp", "tp"]),
    (1024, *DENSE, 0, 300, ["tp", "cp", "dp", "pp"]),
    (1024, *DENSE, 0, 77, "pp"),
    (4096, [8, 2, 16, 8], ["tp", "cp", "dp", "pp"], 1024, 1024, ["tp", "dp", "cp"]),
    (4096, [8, 2, 16, 8], ["tp", "cp", "dp", "pp"], 1024, 3071, "dp"),
    (2048, [4, 16, 3, 8], ["pp", "dp", "cp", "tp"], 500, 1999, ["cp", "pp"]),
]


@pytest.mark.parametrize("world,shape,names,offset,rank,dims", CASES)
def test_create_pg_makes_only_the_callers_group(world, shape, names, offset, rank, dims, fake_world, new_group_calls):
    fake_world(rank, world)
    grid = HyperCommGrid(shape, names, rank_offset=offset)
    pg = grid.create_pg(dims)
    expected = _megatron_row(shape, names, offset, dims, rank)

    assert len(new_group_calls) == 1
    call = new_group_calls[0]
    assert call["use_local_synchronization"] is True
    assert call["ranks"] == expected
    assert dist.get_process_group_ranks(pg) == sorted(expected)
    assert pg.size() == len(expected) and pg.rank() == sorted(expected).index(rank)
    assert grid.get_pg(dims) is pg
    assert grid.group_ranks(dims) == expected
    assert grid.rank_in_group(dims) == expected.index(rank)


def test_several_dim_subsets_one_call_each(fake_world, new_group_calls):
    world, rank = 1024, 613
    fake_world(rank, world)
    shape, names = DENSE
    grid = HyperCommGrid(shape, names)
    subsets = [list(c) for k in range(1, 5) for c in itertools.combinations(names, k)]
    for n, dims in enumerate(subsets, start=1):
        pg = grid.create_pg(dims)
        assert len(new_group_calls) == n
        expected = _megatron_row(shape, names, 0, dims, rank)
        assert new_group_calls[-1]["ranks"] == expected
        assert dist.get_process_group_ranks(pg) == sorted(expected)
    assert all(c["use_local_synchronization"] is True for c in new_group_calls)


@pytest.mark.parametrize("rank", [0, 333, 1023])
def test_expert_view_groups(rank, fake_world, new_group_calls):
    world = 1024
    fake_world(rank, world)
    grid = HyperCommGrid([4, 2, 32, 4], ["tp", "cp", "dp", "pp"])
    expert_shape, expert_names = [2, 8, 16, 4], ["etp", "ep", "edp", "pp"]
    grid.register_view("expert", expert_shape, expert_names, shared_dims=["pp"])
    for n, dims in enumerate(["ep", ["etp", "ep"], "edp", ["etp", "ep", "pp"]], start=1):
        pg = grid.create_pg(dims, view="expert")
        expected = _megatron_row(expert_shape, expert_names, 0, dims, rank)
        assert len(new_group_calls) == n
        assert new_group_calls[-1]["ranks"] == expected
        assert dist.get_process_group_ranks(pg) == sorted(expected)
        assert grid.get_pg(dims, view="expert") is pg
    # the same dims in the base view are a different group key
    assert not grid.has_pg("pp")
    grid.create_pg("pp")
    assert grid.get_pg("pp") is not grid.get_pg(["etp", "ep", "pp"], view="expert")


@pytest.mark.parametrize("rank", [0, 255, 768, 1023])
def test_rank_outside_the_grid_gets_none_and_makes_no_call(rank, fake_world, new_group_calls):
    fake_world(rank, 1024)
    grid = HyperCommGrid([4, 8, 16], ["tp", "dp", "pp"], rank_offset=256)  # ranks 256..767
    assert not grid.is_current_rank_in_grid()
    assert grid.create_pg("tp") is None
    assert grid.create_pg(["dp", "pp"]) is None
    assert grid.get_pg("tp") is None
    assert new_group_calls == []


def test_all_ranks_makes_one_call_per_group_like_megatron(fake_world, new_group_calls):
    world, rank = 1024, 37
    fake_world(rank, world)
    shape, names = [4, 4, 4], ["tp", "dp", "pp"]  # 64 ranks; the rest of the world is outside
    grid = HyperCommGrid(shape, names)
    pg = grid.create_pg(["tp", "pp"], all_ranks=True)
    expected_rows = rank_enum(MegatronGrid(shape, names), ["tp", "pp"])
    assert [c["ranks"] for c in new_group_calls] == expected_rows
    assert not any(c.get("use_local_synchronization") for c in new_group_calls)
    megatron_pg = MegatronGrid(shape, names).create_pg(["tp", "pp"])
    assert dist.get_process_group_ranks(pg) == dist.get_process_group_ranks(megatron_pg)


def test_all_ranks_outside_the_grid_still_takes_part(fake_world, new_group_calls):
    fake_world(900, 1024)
    grid = HyperCommGrid([4, 4, 4], ["tp", "dp", "pp"])
    assert grid.create_pg("dp", all_ranks=True) is None
    assert len(new_group_calls) == 16


def test_kwargs_pass_through(fake_world, new_group_calls):
    fake_world(5, 1024)
    timeout = datetime.timedelta(seconds=123)
    grid = HyperCommGrid([8, 128], ["tp", "dp"], backend="fake")
    tp = grid.create_pg("tp", timeout=timeout, group_desc="MY_TP_GROUP")
    dp = grid.create_pg("dp", backend="fake", group_desc="MY_DP_GROUP")
    first, second = new_group_calls
    assert first["timeout"] == timeout and first["group_desc"] == "MY_TP_GROUP" and first["backend"] == "fake"
    assert second["backend"] == "fake" and second["group_desc"] == "MY_DP_GROUP"
    assert tp.group_desc == "MY_TP_GROUP" and dp.group_desc == "MY_DP_GROUP"
    plain = HyperCommGrid([8, 128], ["tp", "dp"])
    plain.create_pg("tp")
    assert new_group_calls[-1]["backend"] is None  # the default backend


def test_group_keys_are_normalized_like_megatron(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "120")
    shape, names = [2, 3, 4, 5], ["tp", "cp", "pp", "dp"]
    ours, theirs = HyperCommGrid(shape, names), MegatronGrid(shape, names)
    # Megatron's private helper: _order_dims(dims) up to 0.18, _order_dims_for(dim_names, dims) on 0.19
    if hasattr(theirs, "_order_dims"):
        megatron_order = theirs._order_dims
    else:
        megatron_order = functools.partial(theirs._order_dims_for, theirs.dim_names)
    for k in range(1, len(names) + 1):
        for dims in itertools.permutations(names, k):
            assert ours._order_dims(list(dims)) == megatron_order(list(dims))
    for name in names:
        assert ours._order_dims(name) == megatron_order(name)


@pytest.mark.parametrize(
    "first,second",
    [(["tp", "dp"], ["dp", "tp"]), ("tp", ["tp"]), (["cp", "dp", "pp"], ["pp", "cp", "dp"])],
)
def test_second_create_pg_raises_keyerror_like_megatron(first, second, fake_world, new_group_calls):
    fake_world(3, 1024)
    shape, names = DENSE
    grid = HyperCommGrid(shape, names)
    grid.create_pg(first)
    with pytest.raises(KeyError, match="already been created"):
        grid.create_pg(second)
    assert len(new_group_calls) == 1
    megatron_grid = MegatronGrid(shape, names)
    megatron_grid.create_pg(first)
    with pytest.raises(KeyError):
        megatron_grid.create_pg(second)


def test_get_pg_before_create_pg_raises_keyerror(fake_world):
    fake_world(0, 1024)
    grid = HyperCommGrid(*DENSE)
    with pytest.raises(KeyError, match="dp-tp"):
        grid.get_pg(["tp", "dp"])
    with pytest.raises(KeyError):
        MegatronGrid(*DENSE).get_pg(["tp", "dp"])
    grid.register_view("expert", [8, 16, 8], ["etp", "ep", "edp"])
    grid.create_pg("ep", view="expert")
    with pytest.raises(KeyError):
        grid.get_pg("ep")  # created in the expert view only


def test_destroy_destroys_every_group(fake_world, new_group_calls):
    fake_world(9, 1024)
    grid = HyperCommGrid(*DENSE)
    grid.register_view("expert", [8, 16, 8], ["etp", "ep", "edp"])
    pgs = [grid.create_pg("tp"), grid.create_pg(["dp", "cp"]), grid.create_pg("ep", view="expert")]
    pg_map = dist.distributed_c10d._world.pg_map
    assert all(pg in pg_map for pg in pgs)
    grid.destroy()
    assert not any(pg in pg_map for pg in pgs)
    with pytest.raises(KeyError):
        grid.get_pg("tp")
    assert grid.create_pg("tp") is not None  # can be made again after destroy
    assert len(new_group_calls) == 4
    grid.destroy()
    grid.destroy()  # idempotent


# --------------------------------------------------------------------- bad input


def _builtin_base(exc: BaseException) -> type:
    """The most derived built-in class of ``exc`` (megatron may raise library subclasses)."""
    return next(cls for cls in type(exc).__mro__ if cls.__module__ == "builtins")


def _unknown_dim_cases():
    def ours(call):
        def run():
            grid = HyperCommGrid([2, 4], ["tp", "dp"])
            return call(grid)

        return run

    def theirs(call):
        def run():
            grid = MegatronGrid([2, 4], ["tp", "dp"])
            return call(grid)

        run.raises = True
        return run

    cases = {
        "create_pg-str": lambda g: g.create_pg("zz"),
        "create_pg-list": lambda g: g.create_pg(["tp", "zz"]),
        "get_pg-str": lambda g: g.get_pg("zz"),
        "get_pg-list": lambda g: g.get_pg(["zz"]),
    }
    return [
        pytest.param(ours(call), theirs(call), UnknownDimError, "'zz'", id=f"unknown-dim-{name}")
        for name, call in cases.items()
    ]


def _grid(shape, names, offset=0):
    return lambda: HyperCommGrid(shape, names, rank_offset=offset)


def _mgrid(shape, names, offset=0, *, raises=True):
    """Megatron's grid for the same input; ``raises=False`` where megatron accepts it."""
    run = lambda: MegatronGrid(shape, names, rank_offset=offset)  # noqa: E731
    run.raises = raises
    return run


def _view(shape, names, shared, name="expert", twice=False):
    def run():
        grid = HyperCommGrid([2, 2, 4], ["tp", "pp", "dp"])  # 16 ranks, pp stride 2
        if twice:
            grid.register_view(name, shape, names, shared_dims=shared)
        grid.register_view(name, shape, names, shared_dims=shared)

    return run


BAD_INPUT = [
    # (ours, megatron or None, expected type, message pattern)
    pytest.param(
        _grid([2, 2], ["tp"]),
        _mgrid([2, 2], ["tp"]),
        ValueError,
        r"len\(shape\) 2 != len\(dim_names\) 1",
        id="length-mismatch",
    ),
    pytest.param(
        _grid([2, 2], ["tp", "tp"]),
        _mgrid([2, 2], ["tp", "tp"], raises=False),
        ValueError,
        "duplicate name 'tp'",
        id="duplicate-names",
    ),
    pytest.param(
        _grid([2, 0], ["tp", "dp"]),
        _mgrid([2, 0], ["tp", "dp"], raises=False),
        ValueError,
        r"shape\[1\] \(dim 'dp'\) must be >= 1, got 0",
        id="size-zero",
    ),
    pytest.param(
        _grid([-2, 2], ["tp", "dp"]),
        _mgrid([-2, 2], ["tp", "dp"], raises=False),
        ValueError,
        r"shape\[0\] \(dim 'tp'\) must be >= 1, got -2",
        id="size-negative",
    ),
    pytest.param(
        _grid([True, 2], ["tp", "dp"]),
        _mgrid([True, 2], ["tp", "dp"], raises=False),
        TypeError,
        r"shape\[0\].*True \(bool\)",
        id="size-bool",
    ),
    pytest.param(
        _grid([2, 2.0], ["tp", "dp"]),
        _mgrid([2, 2.0], ["tp", "dp"], raises=False),
        TypeError,
        r"shape\[1\].*2\.0 \(float\)",
        id="size-float",
    ),
    pytest.param(
        _grid([2, "2"], ["tp", "dp"]),
        _mgrid([2, "2"], ["tp", "dp"]),
        TypeError,
        r"shape\[1\].*'2' \(str\)",
        id="size-str",
    ),
    pytest.param(
        _grid([8, 16], ["tp", "dp"]),
        _mgrid([8, 16], ["tp", "dp"]),
        RuntimeError,
        r"\[8, 16\] \(128 ranks\).*world size 64",
        id="larger-than-world",
    ),
    pytest.param(
        _grid([4, 8], ["tp", "dp"], 33),
        _mgrid([4, 8], ["tp", "dp"], 33),
        RuntimeError,
        "world size 64 with rank offset 33",
        id="larger-than-world-minus-offset",
    ),
    pytest.param(
        _grid([2, 2], ["tp", "dp"], -1),
        _mgrid([2, 2], ["tp", "dp"], -1),
        ValueError,
        "rank_offset must be >= 0, got -1",
        id="negative-offset",
    ),
    *_unknown_dim_cases(),
    pytest.param(
        _view([1, 4, 2, 2], ["etp", "ep", "pp", "edp"], ["pp"]),
        None,
        ValueError,
        "shared dim 'pp' of view 'expert'",
        id="view-shared-dim-differs",
    ),
    pytest.param(
        _view([2, 2, 2], ["etp", "ep", "pp"], ["pp"]),
        None,
        ValueError,
        r"view 'expert' has shape \[2, 2, 2\] \(8 ranks\) but the grid has 16",
        id="view-wrong-size",
    ),
    pytest.param(
        _view([2, 2, 4], ["etp", "pp", "ep"], ["pp"], twice=True),
        None,
        ValueError,
        "view 'expert' is already registered",
        id="view-duplicate-name",
    ),
    pytest.param(
        _view([2, 2, 4], ["etp", "pp", "ep"], ["zz"]), None, UnknownDimError, "'zz'", id="view-unknown-shared-dim"
    ),
]


@pytest.mark.parametrize("ours,megatron,expected_type,message", BAD_INPUT)
def test_bad_input_raises_immediately_and_names_the_problem(
    ours, megatron, expected_type, message, monkeypatch, fake_world, new_group_calls
):
    fake_world(0, 64)
    monkeypatch.setenv("WORLD_SIZE", "64")
    with pytest.raises(expected_type, match=message) as ours_info:
        ours()
    assert new_group_calls == []
    if megatron is None:
        return  # views are ours alone
    if not megatron.raises:
        megatron()  # megatron takes this input silently: we are stricter
        return
    with pytest.raises(Exception) as theirs_info:
        megatron()
    # megatron may raise a library subclass (numpy, einops): ours must be catchable the same way
    base = _builtin_base(theirs_info.value)
    assert isinstance(ours_info.value, base), (
        f"megatron raises {base.__name__}, we raise {type(ours_info.value).__name__}"
    )


def test_unknown_view_is_a_keyerror(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid([2, 4], ["tp", "dp"])
    with pytest.raises(KeyError, match="unknown view 'expert'"):
        grid.get_pg("tp", view="expert")


def test_no_world_size_and_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="WORLD_SIZE") as ours_info:
        HyperCommGrid([2, 2], ["tp", "dp"])
    with pytest.raises(RuntimeError) as theirs_info:
        MegatronGrid([2, 2], ["tp", "dp"])
    assert type(ours_info.value) is type(theirs_info.value) is RuntimeError
