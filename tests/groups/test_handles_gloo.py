"""GroupHandle: topology on simulated ranks, every helper's numbers on real gloo worlds of 4 and 8."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng import GroupHandle, HyperCommGrid, Layout


# ---------------------------------------------------------------- fake backend (no traffic)
def test_topology_and_ring_on_every_rank(fake_world):
    layout = Layout([2, 2, 2], ["tp", "dp", "pp"])
    for rank in range(8):
        fake_world(rank, 8)
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        for dims in (["pp"], ["tp", "dp"], ["dp", "pp"]):
            h = grid.group(dims, create=True)
            ranks = layout.group_ranks(rank, dims)
            i = ranks.index(rank)
            assert h.ranks == ranks and h.rank == rank and h.rank_in_group == i
            assert h.size == len(h) == len(ranks) == h.group.size()
            assert (h.first_rank, h.last_rank) == (ranks[0], ranks[-1])
            assert (h.is_first, h.is_last) == (i == 0, i == len(ranks) - 1)
            assert h.next_rank == ranks[(i + 1) % len(ranks)]
            assert h.prev_rank == ranks[(i - 1) % len(ranks)]
            assert [h.global_rank(j) for j in range(h.size)] == ranks
            assert rank in h and h.group is grid.get_pg(dims)
            assert grid.group(dims) is h  # cached
            assert not h.has_cpu_group  # nothing created eagerly


def test_group_requires_created_pg(fake_world):
    fake_world(0, 4)
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    with pytest.raises(KeyError, match="create_pg"):
        grid.group("tp")
    h = grid.group("tp", create=True)
    assert h.ranks == [0, 1] and grid.group("tp") is h
    grid.destroy()
    grid.create_pg("tp")
    assert grid.group("tp") is not h  # a new group, a new handle


def test_constructor_errors(fake_world):
    fake_world(2, 4)
    world = dist.group.WORLD
    with pytest.raises(ValueError, match="rank 2 is not a member"):
        GroupHandle([0, 1, 3], world)
    with pytest.raises(ValueError, match="group has ranks"):
        GroupHandle([0, 1, 2], world)  # the world group has 4 ranks
    with pytest.raises(ValueError, match="repeat"):
        GroupHandle([0, 2, 2, 3], world)
    with pytest.raises(ValueError, match="empty"):
        GroupHandle([], world)
    with pytest.raises(TypeError, match="ProcessGroup"):
        GroupHandle([0, 1, 2, 3], None)
    h = GroupHandle([3, 2, 1, 0], world, name="reversed")
    assert (h.rank_in_group, h.next_rank, h.prev_rank, h.first_rank) == (1, 1, 3, 3)
    with pytest.raises(ValueError, match="not both"):
        h.broadcast(torch.zeros(1), group_src=0, global_src=1)
    with pytest.raises(ValueError, match="global_src=7 is not a member"):
        h.broadcast(torch.zeros(1), global_src=7)
    with pytest.raises(ValueError, match="out of range"):
        h.broadcast(torch.zeros(1), group_src=4)
    with pytest.raises(ValueError, match="not divisible"):
        h.reduce_scatter(torch.zeros(6))


def test_single_member_group_short_cuts(fake_world):
    fake_world(1, 2)
    grid = HyperCommGrid([1, 2], ["tp", "dp"])
    h = grid.group("tp", create=True)
    t = torch.arange(4.0)
    assert h.all_reduce(t) is t and h.all_gather(t) is t and h.reduce_scatter(t) is t
    assert h.all_gather(t, as_list=True) == [t] and h.broadcast(t) is t
    assert h.broadcast_object({"a": 1}) == {"a": 1}
    assert h.is_first and h.is_last and h.next_rank == h.prev_rank == 1
    with pytest.raises(ValueError, match="single member"):
        h.send_next(t)


# -------------------------------------------------------------------- gloo worlds
def _pg_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _exercise(h: GroupHandle) -> dict:
    """Every helper on one handle; returns what each produced (checked by the caller)."""
    r, i, n = h.rank, h.rank_in_group, h.size
    out: dict = {"ranks": h.ranks, "rank": r}
    out["all_reduce"] = h.all_reduce(torch.tensor([float(r), 1.0])).tolist()
    out["all_reduce_max"] = h.all_reduce(torch.tensor([float(r)]), op=dist.ReduceOp.MAX).item()
    row = torch.tensor([[float(r), float(10 * r)]])  # shape (1, 2)
    out["gather0"] = h.all_gather(row).tolist()  # (n, 2)
    out["gather1"] = h.all_gather(row, dim=-1).tolist()  # (1, 2n)
    out["gather_list"] = [t.tolist() for t in h.all_gather(torch.tensor(float(r)), as_list=True)]
    # member j contributes (j+1) * [0, 1, ..., 2n-1]; the sum is S * arange, S = n(n+1)/2
    base = torch.arange(2.0 * n) * (i + 1)
    out["rs0"] = h.reduce_scatter(base).tolist()  # chunk i of dim 0
    out["rs1"] = h.reduce_scatter(base.reshape(1, 2 * n).repeat(3, 1), dim=1).tolist()  # (3, 2)
    out["bcast_group"] = h.broadcast(torch.tensor([float(r)]), group_src=n - 1).item()
    out["bcast_global"] = h.broadcast(torch.tensor([float(r)]), global_src=h.ranks[n // 2]).item()
    out["bcast_default"] = h.broadcast(torch.tensor([float(r)])).item()
    out["object"] = h.broadcast_object({"from": r, "items": [r] * 2} if i == 1 else None, group_src=1)
    recv_from_prev = torch.full((2,), -1.0)
    send = torch.tensor([float(r), float(i)])
    works = [h.send_next(send), h.recv_prev(recv_from_prev)]
    for w in works:
        w.wait()
    recv_from_next = torch.full((2,), -1.0)
    works = [h.send_prev(send), h.recv_next(recv_from_next)]
    for w in works:
        w.wait()
    out["ring_prev"] = recv_from_prev.tolist()
    out["ring_next"] = recv_from_next.tolist()
    h.barrier()
    return out


def _expected(h_ranks: list[int], rank: int) -> dict:
    n = len(h_ranks)
    i = h_ranks.index(rank)
    s = n * (n + 1) // 2
    full = [s * k for k in range(2 * n)]
    return {
        "ranks": h_ranks,
        "rank": rank,
        "all_reduce": [float(sum(h_ranks)), float(n)],
        "all_reduce_max": float(max(h_ranks)),
        "gather0": [[float(q), float(10 * q)] for q in h_ranks],
        "gather1": [[v for q in h_ranks for v in (float(q), float(10 * q))]],
        "gather_list": [float(q) for q in h_ranks],
        "rs0": [float(v) for v in full[2 * i : 2 * i + 2]],
        "rs1": [[float(v) for v in full[2 * i : 2 * i + 2]]] * 3,
        "bcast_group": float(h_ranks[-1]),
        "bcast_global": float(h_ranks[n // 2]),
        "bcast_default": float(h_ranks[0]),
        "object": {"from": h_ranks[1], "items": [h_ranks[1]] * 2},
        "ring_prev": [float(h_ranks[(i - 1) % n]), float((i - 1) % n)],
        "ring_next": [float(h_ranks[(i + 1) % n]), float((i + 1) % n)],
    }


def _handles_world_of_4():
    """Tp and dp handles of a 2x2 grid, plus a handle over the world in reversed order."""
    before = _pg_count()
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    handles = []
    try:
        tp = grid.group("tp", create=True)
        dp = grid.group("dp", create=True)
        after_device = _pg_count()
        lazy = (tp.has_cpu_group, dp.has_cpu_group)
        reversed_world = GroupHandle(list(range(dist.get_world_size() - 1, -1, -1)), dist.group.WORLD, name="rev")
        handles = [tp, dp, reversed_world]
        results = {h.name: _exercise(h) for h in handles}
        created_cpu = _pg_count() - after_device  # one gloo companion per handle, made on use
        cpu_cached = tp.cpu_group is tp.cpu_group
        for h in handles:
            h.destroy()
        return {
            "results": results,
            "device_groups": after_device - before,
            "lazy": lazy,
            "cpu_created": created_cpu,
            "cpu_cached": cpu_cached,
            "after_destroy": _pg_count() - after_device,
        }
    finally:
        for h in handles:
            h.destroy()
        grid.destroy()


def test_every_helper_on_a_world_of_4(gloo_world):
    out = gloo_world(4).run(_handles_world_of_4)
    layout = Layout([2, 2], ["tp", "dp"])
    for rank, res in enumerate(out):
        assert res["device_groups"] == 2 and res["lazy"] == (False, False)
        assert res["cpu_created"] == 3 and res["cpu_cached"] and res["after_destroy"] == 0
        expected = {
            "tp": _expected(layout.group_ranks(rank, "tp"), rank),
            "dp": _expected(layout.group_ranks(rank, "dp"), rank),
            "rev": _expected([3, 2, 1, 0], rank),
        }
        for name, exp in expected.items():
            assert res["results"][name] == exp, (rank, name)


def _handles_world_of_8():
    """Handles of a 2x2x2 grid over one, two and three dims, and of a composed view whose
    group order differs from the sorted order of its device group.
    """
    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    # x, y re-express (tp, pp); the group over (y, dp) lists ranks as y fastest, e.g.
    # [0, 4, 2, 6], while new_group sorts them
    grid.register_split_view("xy", ["tp", "pp"], [2, 2], ["x", "y"])
    handles = []
    try:
        handles = [
            grid.group("pp", create=True, cpu=True),
            grid.group(["tp", "dp"], create=True),
            grid.group(["tp", "dp", "pp"], create=True),
            grid.group(["y", "dp"], view="xy", create=True),
        ]
        eager_cpu = handles[0].has_cpu_group
        results = {h.name: _exercise(h) for h in handles}
        device_order = dist.get_process_group_ranks(handles[3].group)
        return {"results": results, "eager_cpu": eager_cpu, "device_order": device_order}
    finally:
        for h in handles:
            h.destroy()
        grid.destroy()


def test_every_helper_on_a_world_of_8(gloo_world):
    out = gloo_world(8).run(_handles_world_of_8)
    base = Layout([2, 2, 2], ["tp", "dp", "pp"])
    xy = base.split(["tp", "pp"], [2, 2], ["x", "y"])
    for rank, res in enumerate(out):
        assert res["eager_cpu"]
        view_ranks = xy.group_ranks(rank, ["y", "dp"])
        assert view_ranks != sorted(view_ranks) and res["device_order"] == sorted(view_ranks)
        expected = {
            "pp": _expected(base.group_ranks(rank, "pp"), rank),
            "dp-tp": _expected(base.group_ranks(rank, ["tp", "dp"]), rank),
            "pp-dp-tp": _expected(list(range(8)), rank),
            "xy:dp-y": _expected(view_ranks, rank),
        }
        assert set(res["results"]) == set(expected)
        for name, exp in expected.items():
            assert res["results"][name] == exp, (rank, name)
