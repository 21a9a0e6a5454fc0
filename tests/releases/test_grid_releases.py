"""HyperCommGrid per megatron-core release: ours against each release's own ``hyper_comm_grid``.

One subprocess per release (``tests.support.releases.wheels.run_in_release``) runs the batch in
``tests/support/releases/grid_checks.py`` on torch's fake backend: public surface (methods present and
absent, signatures; the superset class accepts every release's calls), seeded rank
enumerations (``get_rank_enum``, ``_gen_rank_enum``), ``create_pg`` membership on several
ranks, Megatron's own ``BridgeCommunicator`` leader / boundary-stage helpers (0.15+, they call
``grid._gen_rank_enum``) on both grids, ``destroy`` / ``is_current_rank_in_grid`` (0.17+), the 0.19 views (``register_view``,
keyword-only ``view=``, shared dims reusing the base group) and bad input (the release's
exception types). Then, in this process: the release classes themselves, and a real gloo run
of the view semantics.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng import HyperCommGrid
from parallel_state_ng.builders.grid_releases import hyper_comm_grid_class
from parallel_state_ng.releases import SUPPORTED_SERIES, UnsupportedReleaseError, parse_release
from parallel_state_ng.releases import hyper_comm_grid as facts

# Worker processes import this module (gloo test): keep module-level imports light.

SEED = 20260421

# What each release's run must have exercised (beyond the checks every release gets).
EXPECTED_KINDS = {
    "0.14": {"surface", "_gen_rank_enum", "create_pg", "get_pg", "bad input"},
    "0.15": {"bridge_communicator"},
    "0.16": {"get_rank_enum"},
    "0.17": {"destroy", "is_current_rank_in_grid"},
    "0.19": {"register_view", "view create_pg", "view get_rank_enum", "shared reuse", "view keyword-only"},
}
# The supported releases that have a HyperCommGrid (0.14 on).
GRID_SERIES = [s for s in SUPPORTED_SERIES if facts.has_class(s)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("series", GRID_SERIES)
def test_grid_matches_release(series):
    from tests.support.releases.wheels import RELEASES, run_in_release

    result = run_in_release(RELEASES[series], "tests.support.releases.grid_checks", "run_checks", SEED)
    assert result["served"] == series and result["release"] == RELEASES[series]
    assert result["methods"] == sorted(facts.method_names(series))
    assert result["mismatches"] == [], "\n".join(result["mismatches"][:20])
    expected = set().union(*(kinds for since, kinds in EXPECTED_KINDS.items() if parse_release(series).at_least(since)))
    missing = expected - set(result["checks"])
    assert not missing, f"checks not run on {series}: {missing}"
    assert sum(result["checks"].values()) > 300


def test_release_classes_are_cached_subclasses():
    for series in GRID_SERIES:
        cls = hyper_comm_grid_class(series)
        assert issubclass(cls, HyperCommGrid) and cls.megatron_release == series and cls.__name__ == "HyperCommGrid"
        assert hyper_comm_grid_class(f"{series}.9") is cls
    for series in sorted(set(SUPPORTED_SERIES) - set(GRID_SERIES)):  # 0.12, 0.13: no HyperCommGrid
        with pytest.raises(UnsupportedReleaseError, match="no HyperCommGrid"):
            hyper_comm_grid_class(series)
    with pytest.warns(UserWarning, match="newer"):
        assert hyper_comm_grid_class("0.99").megatron_release == SUPPORTED_SERIES[-1]


def test_release_surface_follows_the_data(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    everything = facts.all_method_names()
    assert set(everything) == set(facts.METHODS)
    for series in GRID_SERIES:
        grid = hyper_comm_grid_class(series)([2, 4], ["tp", "dp"])
        present = facts.methods(series)
        for name in everything:
            if name in present:
                assert inspect.signature(getattr(type(grid), name)) == facts.signature(present[name])
            else:
                assert not hasattr(grid, name) and name not in dir(grid)
        # the engine's extras stay: names no release uses
        assert grid.group_ranks("tp", rank=5) == [4, 5] and grid.coord(5) == {"tp": 1, "dp": 2}
    assert facts.differences("0.14", "0.14") == {} and not facts.has_class("0.13") and facts.has_class("0.14")
    changed = facts.differences("0.16", "0.19")
    assert changed["destroy"][0] is None and "view" in changed["create_pg"][1].parameters
    assert set(changed) == {
        "create_pg",
        "get_pg",
        "get_rank_enum",
        "destroy",
        "is_current_rank_in_grid",
        "register_view",
    }
    # the superset engine has every release's methods
    assert all(hasattr(HyperCommGrid, name) for name in everything)


def test_view_keyword_before_0_19_is_a_typeerror(fake_world):
    fake_world(3, 8)
    old = hyper_comm_grid_class("0.18")([2, 4], ["tp", "dp"])
    with pytest.raises(TypeError, match="view.*0.19.*0.18"):
        old.create_pg("tp", view="base")
    with pytest.raises(TypeError, match="view"):
        old.get_pg("tp", view="base")
    pg = old.create_pg("tp", all_ranks=True)  # our extra keyword passes through **kwargs
    assert dist.get_process_group_ranks(pg) == [2, 3]
    new = hyper_comm_grid_class("0.19")([2, 4], ["tp", "dp"])
    with pytest.raises(TypeError):
        new.get_pg("tp", "base")  # keyword-only
    assert new.create_pg("tp", view="base") is new.get_pg("tp")


def test_engine_view_semantics_of_0_19(fake_world):
    fake_world(5, 16)
    grid = HyperCommGrid([2, 2, 4], ["tp", "pp", "dp"])
    grid.register_view("expert", [2, 2, 4], ["ep", "pp", "edp"], shared_dims=["pp"])
    assert grid.shared_dims("expert") == ["pp"] and grid.shared_dims() == []
    pp = grid.create_pg("pp", view="expert")
    assert grid.get_pg("pp") is pp and grid.has_pg("pp")
    with pytest.raises(KeyError, match="already been created"):
        grid.create_pg("pp")
    ep_pp = grid.create_pg(["ep", "pp"], view="expert")  # not all shared: the view's own group
    assert ep_pp is not pp and dist.get_process_group_ranks(ep_pp) == [4, 5, 6, 7]
    assert grid.group("pp", view="expert") is grid.group("pp")  # one handle for one group
    grid.destroy()


def _shared_dim_groups_work() -> dict:
    """On every rank of 4: the expert view's pp group is the base pp group, and it all-reduces."""
    rank = dist.get_rank()
    grid = hyper_comm_grid_class("0.19")([2, 2], ["dp", "pp"])
    grid.register_view("expert", [2, 2], ["ep", "pp"], shared_dims=["pp"])
    try:
        pp = grid.create_pg("pp", view="expert")
        ep = grid.create_pg("ep", view="expert")
        out = {"same": pp is grid.get_pg("pp")}
        for name, pg in (("pp", pp), ("ep", ep)):
            value = torch.tensor([rank], dtype=torch.int64)
            dist.all_reduce(value, group=pg)
            out[name] = (int(value.item()), dist.get_process_group_ranks(pg))
        return out
    finally:
        grid.destroy()


def test_shared_dim_group_reuse_works_on_gloo(gloo_world):
    results = gloo_world(4).run(_shared_dim_groups_work)
    for rank, got in enumerate(results):
        pp_group = [rank % 2, rank % 2 + 2]
        ep_group = [rank - rank % 2, rank - rank % 2 + 1]
        assert got == {"same": True, "pp": (sum(pp_group), pp_group), "ep": (sum(ep_group), ep_group)}
