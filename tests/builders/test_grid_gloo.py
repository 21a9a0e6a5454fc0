"""HyperCommGrid groups in a real multi-process gloo world.

Every rank builds the grid, creates its groups (only its own, with local synchronization) and
all-reduces its global rank over each of them; the sum must be the sum of the members of the
rank's group in megatron's enumeration. Ranks outside the grid get no group and keep working.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng import HyperCommGrid
from parallel_state_ng.releases import hyper_comm_grid as grid_facts

# Worker processes import this module to find the functions below: keep it light (no
# megatron import at module level).


def _sum_ranks_over_groups(shape, names, offset, views, requests):
    """On every rank: create each requested group, all-reduce the global rank over it.

    ``views`` are ``(name, shape, dim_names, shared_dims)`` or ``(name, ("split", dims,
    shape, dim_names))``; ``requests`` are ``(view, dims)``. Returns, per request, ``None``
    for a rank outside the grid, else ``(all-reduced sum, ranks of the created group)``.
    """
    rank = dist.get_rank()
    grid = HyperCommGrid(shape, names, rank_offset=offset)
    for view in views:
        if view[1][0] == "split":
            _, split_dims, split_shape, split_names = view[1]
            grid.register_split_view(view[0], split_dims, split_shape, split_names)
        else:
            grid.register_view(*view)
    out = []
    try:
        for view, dims in requests:
            pg = grid.create_pg(dims, view=view)
            if pg is None:
                out.append(None)
                continue
            value = torch.tensor([rank], dtype=torch.int64)
            dist.all_reduce(value, group=pg)
            out.append((int(value.item()), dist.get_process_group_ranks(pg)))
        # the whole world still works afterwards, inside and outside the grid
        total = torch.tensor([1], dtype=torch.int64)
        dist.all_reduce(total)
        assert total.item() == dist.get_world_size()
    finally:
        grid.destroy()
    return out


def _expected_rows(shape, names, offset, dims, monkeypatch) -> list[list[int]]:
    megatron_hcg = pytest.importorskip("megatron.core.hyper_comm_grid")
    monkeypatch.setenv("WORLD_SIZE", str(offset + math.prod(shape)))
    grid = megatron_hcg.HyperCommGrid(list(shape), list(names), rank_offset=offset)
    if "get_rank_enum" in grid_facts.method_names():
        return grid.get_rank_enum(dims)
    # 0.14 and 0.15 have no get_rank_enum (0.16 on): what create_pg enumerates, as it does
    ordered_dims, _ = grid._order_dims(dims)
    return grid._gen_rank_enum(ordered_dims)


def _check(world, results, requests, rows_by_request):
    grid_ranks = {r for rows in rows_by_request for row in rows for r in row}
    for rank in range(world.world_size):
        for i, (view, dims) in enumerate(requests):
            got = results[rank][i]
            if rank not in grid_ranks:
                assert got is None, f"rank {rank} is outside the grid but got a {dims} group"
                continue
            (row,) = [row for row in rows_by_request[i] if rank in row]
            total, members = got
            assert members == sorted(row), f"rank {rank}, {view}:{dims}"
            assert total == sum(row), f"rank {rank}, {view}:{dims}: all-reduce gave {total}, members {row}"


DENSE_SUBSETS = ["tp", "dp", "pp", ["tp", "dp"], ["tp", "pp"], ["dp", "pp"], ["tp", "dp", "pp"]]


EXPERT_REQUESTS = [("expert", "ep"), ("expert", ["etp", "ep"]), ("expert", "edp"), ("expert", ["ep", "pp"])]


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,names,expert_shape,expert_names",
    [
        ([2, 2, 2], ["tp", "dp", "pp"], [1, 2, 2, 2], ["etp", "ep", "edp", "pp"]),
        ([2, 2, 2], ["pp", "tp", "dp"], [2, 1, 2, 2], ["pp", "etp", "ep", "edp"]),
        ([4, 1, 2], ["dp", "pp", "tp"], [2, 1, 1, 4], ["edp", "pp", "etp", "ep"]),
    ],
    ids=["tp-dp-pp", "pp-tp-dp", "dp4-pp1-tp2"],
)
def test_groups_all_reduce_over_their_members(shape, names, expert_shape, expert_names, gloo_world, monkeypatch):
    world = gloo_world(8)
    views = [("expert", expert_shape, expert_names, ["pp"])]
    requests = [(None, dims) for dims in DENSE_SUBSETS] + EXPERT_REQUESTS
    results = world.run(_sum_ranks_over_groups, shape, names, 0, views, requests)

    rows = []
    for view, dims in requests:
        if view is None:
            rows.append(_expected_rows(shape, names, 0, dims, monkeypatch))
        else:
            rows.append(_expected_rows(expert_shape, expert_names, 0, dims, monkeypatch))
    _check(world, results, requests, rows)


def test_split_view_groups(gloo_world, monkeypatch):
    world = gloo_world(8)
    shape, names = [4, 2], ["cp", "pp"]
    views = [("hcp", ("split", "cp", [2, 2], ["cp0", "cp1"]))]
    requests = [("hcp", "cp0"), ("hcp", "cp1"), ("hcp", ["cp0", "pp"]), (None, "cp")]
    results = world.run(_sum_ranks_over_groups, shape, names, 0, views, requests)
    # level 0: neighbours in each cp group; level 1: stride 2 within it
    cp0 = [[0, 1], [2, 3], [4, 5], [6, 7]]
    cp1 = [[0, 2], [1, 3], [4, 6], [5, 7]]
    cp0_pp = [[0, 1, 4, 5], [2, 3, 6, 7]]
    rows = [cp0, cp1, cp0_pp, _expected_rows(shape, names, 0, "cp", monkeypatch)]
    _check(world, results, requests, rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,names,offset",
    [([2], ["tp"], 2), ([3, 1], ["dp", "pp"], 1), ([1, 2], ["tp", "dp"], 1)],
    ids=["tp2-at-2", "dp3-at-1", "tp1-dp2-at-1"],
)
def test_grid_on_part_of_the_world(shape, names, offset, gloo_world, monkeypatch):
    world = gloo_world(4)
    requests = [(None, name) for name in names] + ([(None, list(names))] if len(names) > 1 else [])
    results = world.run(_sum_ranks_over_groups, shape, names, offset, [], requests)
    rows = [_expected_rows(shape, names, offset, dims, monkeypatch) for _, dims in requests]
    _check(world, results, requests, rows)
    outside = [r for r in range(4) if not offset <= r < offset + math.prod(shape)]
    assert outside and all(results[r] == [None] * len(requests) for r in outside)
