"""DeviceMesh over a grid's existing groups: layout of the mesh, no new communicators, DTensor."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng import HyperCommGrid, Layout
from parallel_state_ng.groups.device_mesh import mesh_dim_specs, slice_mesh_ranks


def _pg_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)


# ----------------------------------------------------------------- pure layout of the mesh
@pytest.mark.parametrize(
    "dims",
    [
        ["tp"],
        ["tp", "dp"],
        ["dp", "tp"],
        ["pp", "tp", "dp"],
        [("tp", "dp")],
        [("dp", "tp"), "pp"],
        ["cp", ("pp", "tp")],
    ],
)
def test_slice_mesh_ranks_matches_brute_force(dims):
    layout = Layout([2, 3, 2, 2], ["tp", "cp", "dp", "pp"], rank_offset=4)
    specs, names = mesh_dim_specs(layout, dims)
    assert names == [d if isinstance(d, str) else "_".join(d) for d in dims]
    for rank in range(4, 4 + layout.size):
        mesh = slice_mesh_ranks(layout, rank, specs)
        assert list(mesh.shape) == [layout.group_size(s) for s in specs]
        me = layout.coord(rank)
        for index in itertools.product(*(range(n) for n in mesh.shape)):
            coord = dict(me)
            for axis, spec in zip(index, specs):
                for name in spec:  # layout order, first fastest
                    coord[name] = axis % layout.size_of(name)
                    axis //= layout.size_of(name)
            assert mesh[index].item() == layout.rank(coord)


def test_mesh_dim_specs_errors():
    layout = Layout([2, 2, 2], ["tp", "dp", "pp"])
    with pytest.raises(ValueError, match="repeat"):
        mesh_dim_specs(layout, ["tp", ("tp", "dp")])
    with pytest.raises(ValueError, match="at least one"):
        mesh_dim_specs(layout, [])
    with pytest.raises(ValueError, match="names no grid dim"):
        mesh_dim_specs(layout, ["tp", ()])
    with pytest.raises(KeyError, match="unknown dim 'ep'"):
        mesh_dim_specs(layout, ["ep"])


# ------------------------------------------------------------------------ fake backend
def test_mesh_uses_grid_groups_on_every_rank(fake_world):
    for rank in range(8):
        fake_world(rank, 8)
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        with pytest.raises(KeyError, match="create_pg"):
            grid.device_mesh(["tp", "dp"])
        for dims in ("tp", "dp", "pp", ["tp", "dp"]):
            grid.create_pg(dims)
        before = _pg_count()
        for dims in (["tp", "dp"], ["dp", "pp", "tp"], "pp", [("tp", "dp")]):
            mesh = grid.device_mesh(dims)
            specs = [dims] if isinstance(dims, str) else dims
            names = tuple(d if isinstance(d, str) else "_".join(d) for d in specs)
            assert mesh.mesh_dim_names == names and mesh.device_type == "cpu"
            coord = grid.coord()
            # tuple(): torch's DeviceMesh.get_coordinate() gives a list up to 2.10 (read in 2.10.0), a tuple from 2.11
            assert tuple(mesh.get_coordinate()) == tuple(grid.rank_in_group(d) for d in specs)
            for name, spec in zip(names, specs):
                assert mesh.get_group(name) is grid.get_pg(spec)
                assert mesh.get_local_rank(name) == grid.rank_in_group(spec)
                if isinstance(spec, str):
                    assert mesh.get_local_rank(name) == coord[spec]
            assert rank in mesh.mesh.flatten().tolist()
        assert _pg_count() == before  # no group created by any mesh


def test_create_makes_only_the_missing_mesh_groups(fake_world):
    fake_world(5, 8)
    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    grid.create_pg("tp")
    before = _pg_count()
    mesh = grid.device_mesh(["pp", "tp"], create=True)
    assert _pg_count() == before + 1 and grid.has_pg("pp") and not grid.has_pg("dp")
    assert mesh.mesh.tolist() == [[0, 1], [4, 5]]
    assert tuple(mesh.get_coordinate()) == (1, 1)  # a list up to torch 2.10


def test_mesh_refuses_a_group_whose_order_is_not_the_layout_order(fake_world):
    fake_world(0, 8)
    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    grid.register_split_view("xy", ["tp", "pp"], [2, 2], ["x", "y"])
    grid.create_pg(["y", "dp"], view="xy")  # layout order [0, 4, 2, 6]; new_group sorts it
    with pytest.raises(ValueError, match=r"order \[0, 2, 4, 6\].*needs \[0, 4, 2, 6\]"):
        grid.device_mesh([("y", "dp")], view="xy")
    mesh = grid.device_mesh(["dp", "y"], view="xy", create=True)  # one dim each: fine
    assert mesh.mesh.tolist() == [[0, 4], [2, 6]]


def test_rank_outside_grid_has_no_mesh(fake_world):
    fake_world(0, 8)
    grid = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)
    grid.create_pg("tp")
    with pytest.raises(ValueError, match="rank 0 is outside the grid"):
        grid.device_mesh("tp")


# ------------------------------------------------------------------------- gloo worlds
def _dtensor_world_of_4():
    """A 2x2 (tp, dp) mesh and a 1-D tp mesh from a grid; DTensor redistributes on them."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rank = dist.get_rank()
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    try:
        grid.create_pg("tp")
        grid.create_pg("dp")
        calls = []
        real_new_group = dist.new_group

        def counting_new_group(*args, **kwargs):
            calls.append(args)
            return real_new_group(*args, **kwargs)

        before = _pg_count()
        dist.new_group = counting_new_group
        try:
            mesh = grid.device_mesh(["tp", "dp"])
            mesh1 = grid.device_mesh("tp")
        finally:
            dist.new_group = real_new_group
        out = {
            "new_group_calls": len(calls),
            "pg_delta_mesh": _pg_count() - before,
            "coordinate": mesh.get_coordinate(),
            "local": (mesh.get_local_rank("tp"), mesh.get_local_rank("dp")),
            "coord": grid.coord(),
            "mesh": mesh.mesh.tolist(),
            "same_groups": (mesh.get_group("tp") is grid.get_pg("tp"), mesh.get_group("dp") is grid.get_pg("dp")),
            "mesh1": (mesh1.mesh.tolist(), mesh1.get_coordinate(), mesh1.get_local_rank()),
        }
        tp, dp = grid.coord()["tp"], grid.coord()["dp"]
        full = torch.arange(32.0).reshape(8, 4)
        # rows sharded over tp, replicated over dp
        x = DTensor.from_local(full.chunk(2, 0)[tp].clone(), mesh, [Shard(0), Replicate()])
        rep = x.redistribute(mesh, [Replicate(), Replicate()])
        out["replicated"] = rep.to_local().tolist()
        # back to sharded, rows over tp and columns over dp
        back = rep.redistribute(mesh, [Shard(0), Shard(1)])
        out["sharded"] = back.to_local().tolist()
        out["expected_sharded"] = full.chunk(2, 0)[tp].chunk(2, 1)[dp].tolist()
        out["full_tensor"] = back.full_tensor().tolist()
        # rows over tp -> columns over tp (all-to-all)
        out["shard0_to_shard1"] = x.redistribute(mesh, [Shard(1), Replicate()]).to_local().tolist()
        out["expected_shard1"] = full.chunk(2, 1)[tp].tolist()
        # partial sums over dp -> replicate (all-reduce) and -> shard (reduce-scatter)
        p = DTensor.from_local(torch.full((4, 2), float(rank)), mesh, [Replicate(), Partial()])
        out["partial_to_rep"] = p.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist()
        out["partial_to_shard"] = p.redistribute(mesh, [Replicate(), Shard(0)]).to_local().tolist()
        out["dp_sum"] = float(sum(grid.group_ranks("dp")))
        # 1-D mesh over tp
        y = DTensor.from_local(full.chunk(2, 0)[tp].clone(), mesh1, [Shard(0)])
        out["mesh1_replicated"] = y.redistribute(mesh1, [Replicate()]).to_local().tolist()
        out["mesh1_back"] = y.redistribute(mesh1, [Replicate()]).redistribute(mesh1, [Shard(0)]).to_local().tolist()
        out["pg_delta_total"] = _pg_count() - before
        return out
    finally:
        grid.destroy()


@pytest.mark.slow
def test_dtensor_on_grid_meshes_world_of_4(gloo_world):
    out = gloo_world(4).run(_dtensor_world_of_4)
    full = torch.arange(32.0).reshape(8, 4)
    layout = Layout([2, 2], ["tp", "dp"])
    for rank, res in enumerate(out):
        c = layout.coord(rank)
        assert res["new_group_calls"] == 0 and res["pg_delta_mesh"] == 0 and res["pg_delta_total"] == 0
        assert res["coord"] == c and res["coordinate"] == (c["tp"], c["dp"]) == res["local"]
        assert res["mesh"] == [[0, 2], [1, 3]] and res["same_groups"] == (True, True)
        assert res["mesh1"] == (layout.group_ranks(rank, "tp"), (c["tp"],), c["tp"])
        assert res["replicated"] == full.tolist() == res["full_tensor"]
        assert res["sharded"] == res["expected_sharded"]
        assert res["shard0_to_shard1"] == res["expected_shard1"]
        assert res["partial_to_rep"] == [[res["dp_sum"]] * 2] * 4
        assert res["partial_to_shard"] == [[res["dp_sum"]] * 2] * 2
        assert res["mesh1_replicated"] == full.tolist()
        assert res["mesh1_back"] == full.chunk(2, 0)[c["tp"]].tolist()


def _dtensor_world_of_8():
    """Per-pp-slice (dp, tp) meshes of a 2x2x2 grid and a merged (tp, dp) 1-D mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    try:
        before = _pg_count()
        mesh = grid.device_mesh(["dp", "tp"], create=True)
        flat = grid.device_mesh([("tp", "dp")], create=True)
        created = _pg_count() - before
        c = grid.coord()
        base = torch.arange(16.0).reshape(4, 4) + 100 * c["pp"]  # each pp slice its own data
        x = DTensor.from_local(base.chunk(2, 0)[c["dp"]].chunk(2, 1)[c["tp"]].clone(), mesh, [Shard(0), Shard(1)])
        z = DTensor.from_local(base.chunk(4, 0)[grid.rank_in_group(["tp", "dp"])].clone(), flat, [Shard(0)])
        return {
            "created": created,
            "mesh": mesh.mesh.tolist(),
            "coordinate": mesh.get_coordinate(),
            "flat": (flat.mesh.tolist(), flat.get_coordinate(), flat.mesh_dim_names),
            "coord": c,
            "full": x.full_tensor().tolist(),
            "flat_full": z.redistribute(flat, [Replicate()]).to_local().tolist(),
            "expected": base.tolist(),
            "pg_delta": _pg_count() - before,
        }
    finally:
        grid.destroy()


@pytest.mark.slow
def test_slice_meshes_world_of_8(gloo_world):
    out = gloo_world(8).run(_dtensor_world_of_8)
    layout = Layout([2, 2, 2], ["tp", "dp", "pp"])
    for rank, res in enumerate(out):
        c = layout.coord(rank)
        o = 4 * c["pp"]
        assert res["created"] == 3 and res["pg_delta"] == 3  # dp, tp, (tp, dp); nothing else
        assert res["coord"] == c and res["coordinate"] == (c["dp"], c["tp"])
        assert res["mesh"] == [[o, o + 1], [o + 2, o + 3]]
        assert res["flat"] == ([o, o + 1, o + 2, o + 3], (rank - o,), ("tp_dp",))
        assert res["full"] == res["expected"] == res["flat_full"]
