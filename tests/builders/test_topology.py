"""Multi-module topologies: spec validation, per-rank groups, grids equal to Megatron's, one destroy.

Fake backend (simulated ranks): a table of invalid specs (each refused with its module and
numbers named, before any ``new_group``), the two-module layout of Megatron's MiMo example
(an encoder on ranks 0-1, a language model on 2-5) and a colocated variant on every rank,
each module's grid against Megatron's own ``HyperCommGrid`` over the same ranks, only the
rank's own groups, atomic failure and leak-free destroy. The 0.19 multi-module collection
and ``RankRole`` are checked in a 0.19.2 process.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch.distributed as dist

from parallel_state_ng.builders.topology import EXPERT_VIEW, build_topology, module_grid_dims
from parallel_state_ng.layout.topology_spec import ModuleSpec, TopologySpecError, validate_topology
from tests.support.releases import wheels
from tests.support.releases.grid_checks import rank_enum


def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def encoder_and_language() -> list[ModuleSpec]:
    """The MiMo shape: an encoder (tp1 dp2, ranks 0-1) feeding a language model (tp2 dp2, ranks 2-5)."""
    return [
        ModuleSpec("vision", range(0, 2)),
        ModuleSpec("language", range(2, 6), tensor_model_parallel_size=2, language=True),
    ]


def colocated() -> list[ModuleSpec]:
    """Both modules on ranks 0-3 with their own parallelism."""
    return [
        ModuleSpec("vision", range(0, 4), tensor_model_parallel_size=1),
        ModuleSpec(
            "language", range(0, 4), tensor_model_parallel_size=2, pipeline_model_parallel_size=2, language=True
        ),
    ]


def lm(ranks, **kw) -> ModuleSpec:
    return ModuleSpec("language", ranks, language=True, **kw)


def enc(ranks, name="vision", **kw) -> ModuleSpec:
    return ModuleSpec(name, ranks, **kw)


# (spec, world, fragment of the message)
BAD_SPECS = [
    ([], 4, "non-empty list"),
    ("language", 4, "non-empty list"),
    ({"language": lm(range(4))}, 4, "non-empty list"),
    ([lm(range(4)), "vision"], 4, "modules\\[1\\] must be a ModuleSpec"),
    ([lm(range(4)), enc(range(4), name="")], 4, "name must be an identifier"),
    ([lm(range(4)), enc(range(4), name="my vision")], 4, "name must be an identifier"),
    ([lm(range(0, 2)), enc(range(2, 4), name="language")], 4, "repeated: \\['language'\\]"),
    ([enc(range(0, 4))], 4, "exactly one language module .* got 0"),
    ([lm(range(0, 2)), ModuleSpec("lm2", range(2, 4), language=True)], 4, "exactly one language module .* got 2"),
    ([lm(range(0, 4)), enc(range(4, 8))], 6, "'vision': ranks 4..7 exceed the world of 6"),
    ([lm(range(0, 3)), enc(range(2, 4))], 4, "'language' \\(ranks 0..2\\) and 'vision' \\(ranks 2..3\\) overlap"),
    ([lm(range(0, 4)), enc(range(0, 2))], 4, "overlap without being colocated"),
    ([lm(range(0, 2)), enc(range(3, 4))], 4, "ranks 2..2 of the world of 4 belong to no module"),
    ([lm(range(0, 2))], 4, "ranks 2..3 of the world of 4 belong to no module"),
    ([lm(range(1, 4))], 4, "ranks 0..0 of the world of 4 belong to no module"),
    ([lm(range(0, 4, 2)), enc(range(1, 4, 2))], 4, "contiguous"),
    ([lm((0, "4"))], 4, "must be ints"),
    ([lm([0, 1, 2, 3])], 4, "range or a \\(start, stop\\) pair"),
    ([lm(range(2, 2)), enc(range(0, 4))], 4, "non-empty range"),
    ([lm(range(4), tensor_model_parallel_size=3)], 4, "'language': its 4 ranks .* not divisible by .* = 3"),
    ([lm(range(2)), enc(range(2, 6), pipeline_model_parallel_size=3)], 6, "'vision': its 4 ranks"),
    ([lm(range(4), expert_model_parallel_size=8)], 4, "expert .* = 8"),
    ([lm(range(4), tensor_model_parallel_size=0)], 4, "tensor_model_parallel_size must be an int >= 1, got 0"),
    ([lm(range(4), context_parallel_size=True)], 4, "context_parallel_size must be an int >= 1, got True"),
    ([lm(range(4), order=3)], 4, "order must be a str"),
    ([lm(range(4), order="tp-dp-pp", context_parallel_size=2)], 4, "'language' on ranks 0..3: .*cp"),
    ([lm(range(4), options={"tensor_model_parallel_size": 2})], 4, "unknown option"),
    ([lm(range(4), options=[("gtp_remat_size", 2)])], 4, "options must be a mapping"),
    ([ModuleSpec("language", range(4), language="yes")], 4, "language must be a bool"),
    ([lm(range(0, 2)), enc(range(2, 4), options={"num_distributed_optimizer_instances": 4})], 4, "'vision'"),
]


@pytest.mark.parametrize("spec,world,message", BAD_SPECS, ids=[f"bad{i}" for i in range(len(BAD_SPECS))])
def test_bad_specs_fail_before_any_group(spec, world, message, fake_world, new_group_calls):
    fake_world(0, world)
    before = _live_groups()
    with pytest.raises(TopologySpecError, match=message):
        build_topology(spec, release="0.19")
    assert new_group_calls == [] and _live_groups() == before


def test_at_least_25_bad_specs():
    assert len(BAD_SPECS) >= 25


def test_ranges_before_017_are_refused(fake_world):
    with pytest.raises(TopologySpecError, match="rank offsets came in 0.17"):
        validate_topology(encoder_and_language(), 6, "0.16")
    assert [p.colocated_with for p in validate_topology(colocated(), 4, "0.16")] == [("language",), ("vision",)]


def _megatron_grid(placement):
    """Megatron's own HyperCommGrid over the module's ranks, dims as our grid's."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    names, sizes, _, _ = module_grid_dims(placement.layout)
    return HyperCommGrid(sizes, names, rank_offset=placement.ranks.start)


@pytest.mark.parametrize("spec_of", [encoder_and_language, colocated])
def test_every_rank_holds_its_modules_groups(spec_of, fake_world, new_group_calls):
    pytest.importorskip("megatron.core.hyper_comm_grid")
    spec = spec_of()
    world = max(s.ranks.stop for s in spec)
    for rank in range(world):
        fake_world(rank, world)
        del new_group_calls[:]
        before = _live_groups()
        topo = build_topology(spec, release="0.19")
        try:
            mine = [s.name for s in spec if rank in s.ranks]
            assert topo.modules_of_rank == mine
            for name, placement in topo.placements.items():
                grid, theirs = topo.grid(name), _megatron_grid(placement)
                assert (grid.rank_offset, grid.size, grid.dim_names, grid.shape) == (
                    theirs.rank_offset,
                    theirs.size,
                    theirs.dim_names,
                    theirs.shape,
                )
                for k in range(1, len(grid.dim_names) + 1):
                    for dims in itertools.combinations(grid.dim_names, k):
                        assert grid._gen_rank_enum(list(dims)) == theirs._gen_rank_enum(list(dims)), dims
                        assert rank_enum(grid, list(dims)) == rank_enum(theirs, list(dims)), dims
                if name not in mine:
                    assert grid.get_pg("tp") is None and not topo.groups(name).is_member
                    continue
                fields = topo.groups(name).field_ranks()
                assert fields["tp"] == grid.group_ranks("tp") == dist.get_process_group_ranks(grid.get_pg("tp"))
                assert fields["dp"] == grid.group_ranks("dp") and fields["pp"] == grid.group_ranks("pp")
                assert fields["expt_dp"] == grid.group_ranks("edp", view=EXPERT_VIEW)
                assert grid.get_pg("pp", view=EXPERT_VIEW) is grid.get_pg("pp")
                if name == "language":
                    assert fields["embd"] is not None or rank not in (fields["pp"][0], fields["pp"][-1])
                else:
                    assert fields["embd"] is None and fields["pos_embd"] is None
            # only this rank's groups were asked for, each exactly once per module
            assert all(rank in c for c in new_group_calls)
        finally:
            topo.destroy()
        assert _live_groups() == before


def test_colocated_modules_keep_their_own_groups(fake_world):
    fake_world(1, 4)
    with build_topology(colocated(), release="0.19") as topo:
        vision, language = topo.groups("vision"), topo.groups("language")
        assert vision.ranks("tp") == [1] and language.ranks("tp") == [0, 1]
        assert vision.ranks("dp") == [0, 1, 2, 3] and language.ranks("pp") == [1, 3]
        assert vision.group("dp") is not language.group("dp")
        assert "vision@0..3, language@0..3" in repr(topo)


def test_a_failure_in_a_later_module_leaves_nothing(fake_world, monkeypatch):
    fake_world(0, 4)
    before = _live_groups()
    original, count = dist.new_group, {"n": 0}

    def failing(*args, **kwargs):
        count["n"] += 1
        if count["n"] == 12:  # inside the second (language) module
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", failing)
    with pytest.raises(RuntimeError, match="injected"):
        build_topology(colocated(), release="0.19")
    assert count["n"] == 12 and _live_groups() == before


def test_unknown_module_name_is_a_clear_error(fake_world):
    fake_world(0, 6)
    with build_topology(encoder_and_language(), release="0.19") as topo:
        with pytest.raises(KeyError, match="no module named 'audio'.*modules: \\['vision', 'language'\\]"):
            topo.grid("audio")


# --------------------------------------------------------------------------- 0.19.2 process
def multi_module_report() -> dict:
    """In a 0.19.2 process: MultiModuleProcessGroupCollection and RankRole from our topology, per rank."""
    import importlib.util

    import megatron.core

    from parallel_state_ng.testing.worlds import init_simulated_rank

    # role.py alone: the mimo package's __init__ imports the whole model stack (and triton).
    path = Path(megatron.core.__path__[0]) / "models" / "mimo" / "config" / "role.py"
    spec = importlib.util.spec_from_file_location("mimo_role", path)
    assert spec is not None and spec.loader is not None
    role_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(role_module)
    ModuleLayout, RankRole = role_module.ModuleLayout, role_module.RankRole

    out = {}
    for spec_name, spec_of in (("non_colocated", encoder_and_language), ("colocated", colocated)):
        spec = spec_of()
        world = max(s.ranks.stop for s in spec)
        for rank in range(world):
            init_simulated_rank(rank, world, replace=True)
            with build_topology(spec) as topo:
                mm = topo.multi_module_collection()
                role = RankRole.build(["vision"], topo.module_to_grid_map())
                out[f"{spec_name}/{rank}"] = {
                    "modules": sorted(mm.module_pgs),
                    "language": mm.language_model_module_name,
                    "language_tp": None
                    if not mm.has_language_model()
                    else dist.get_process_group_ranks(mm.get_language_model_collection().tp),
                    "role_modules": sorted(role.modules),
                    "role_mode": role.mode.value,
                    "colocated_mode": ModuleLayout.COLOCATED.value,
                    "first_last": {n: [i.is_first_stage, i.is_last_stage] for n, i in role.modules.items()},
                }
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
def test_multi_module_collection_and_rank_role_on_019():
    report = wheels.run_in_release(wheels.RELEASES["0.19"], __name__, "multi_module_report")
    for rank in (0, 1):
        r = report[f"non_colocated/{rank}"]
        assert r["modules"] == ["vision"] and r["language"] is None and r["role_modules"] == ["vision"]
        assert r["role_mode"] == "non_colocated"
    for rank in (2, 3, 4, 5):
        r = report[f"non_colocated/{rank}"]
        assert r["modules"] == ["language"] and r["language"] == "language"
        assert r["language_tp"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
    for rank in range(4):
        r = report[f"colocated/{rank}"]
        assert r["modules"] == ["language", "vision"] and r["role_mode"] == r["colocated_mode"]
        assert r["language_tp"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
