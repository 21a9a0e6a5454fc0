"""``verify_groups`` on a real gloo world of 4 ranks: every source, every trap, the bad-input table.

The stated configuration is ``tensor_model_parallel_size=2`` (dp 2). Sources built by us
(``build_megatron_groups``), by compat (``compat.parallel_state`` after init and
``compat.pg_collection``), by MCore itself (its ``parallel_state`` and
``ProcessGroupCollection.use_mpu_process_groups()``), by our and MCore's ``HyperCommGrid`` and by a
torch ``DeviceMesh`` must pass; collections made by hand with one mistake each must name that trap
on the right field. Each table runs as one ``world.run`` (spawning is slow); the local half at
65,536 simulated ranks is in ``tests/builders/test_verify_fake.py``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from tests.support.served import has_collection, skip_unless

# Worker processes import this module: keep megatron out of its module level.

CFG: dict[str, Any] = {"tensor_model_parallel_size": 2}


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """A scenario's result as plain data: the report's findings, or the exception raised."""
    from parallel_state_ng.builders.verify import VerifyReport

    try:
        report = fn()
    except Exception as err:  # noqa: BLE001 - the exception is the result
        return {"error": type(err).__name__, "message": str(err)}
    assert isinstance(report, VerifyReport)
    return {
        "ok": report.ok,
        "findings": sorted((m.rank, m.where, m.trap) for m in report.mismatches),
        "text": report.render(),
        "checked": report.checked,
    }


def _destroy_mesh(mesh: Any) -> None:
    """Destroy the groups a DeviceMesh created (the gloo world's workers outlive the test)."""
    names = [*mesh.mesh_dim_names, *getattr(mesh, "_flatten_mapping", {})]
    for group in {id(g): g for g in (mesh.get_group(name) for name in names)}.values():
        if group is not dist.group.WORLD:  # a dim over every rank is the default group itself
            dist.destroy_process_group(group)


def _ours_collection():
    from parallel_state_ng.builders.collection import build_megatron_groups

    return build_megatron_groups(**CFG)


# --------------------------------------------------------------------------- sources that pass
def _good_sources() -> dict[str, dict[str, Any]]:
    """Every source built right: each report must be ok."""
    from megatron.core.hyper_comm_grid import HyperCommGrid as MCoreGrid
    from torch.distributed.device_mesh import init_device_mesh

    import compat
    import compat.parallel_state as cps
    from compat.pg_collection import to_process_group_collection
    from parallel_state_ng import HyperCommGrid, verify_groups
    from tests.support.differential.observe import reset_mcore

    out = {}
    with _ours_collection() as ours:
        out["ours: MegatronGroups"] = _outcome(lambda: verify_groups(ours, **CFG))
        out["ours: collection"] = _outcome(lambda: verify_groups(ours.collection(), **CFG))
    cps.initialize_model_parallel(**CFG)
    try:
        out["compat: parallel_state"] = _outcome(lambda: verify_groups(cps, **CFG))
        out["compat: pg_collection"] = _outcome(lambda: verify_groups(to_process_group_collection(), **CFG))
        out["compat.verify_groups"] = _outcome(lambda: compat.verify_groups(**CFG))
    finally:
        cps.destroy_model_parallel()
    import megatron.core.parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection

    reset_mcore()
    before = set(dist.distributed_c10d._world.pg_map)
    mps.initialize_model_parallel(**CFG, create_gloo_process_groups=False)
    try:
        out["mcore: parallel_state"] = _outcome(lambda: verify_groups(mps, **CFG))
        collection = ProcessGroupCollection.use_mpu_process_groups()
        out["mcore: use_mpu_process_groups"] = _outcome(lambda: verify_groups(collection, **CFG))
    finally:
        mps.destroy_model_parallel()
        reset_mcore()
        # MCore's destroy keeps its groups alive; this world is shared with other tests
        for group in set(dist.distributed_c10d._world.pg_map) - before:
            dist.destroy_process_group(group)
    for name, cls in (("ours: HyperCommGrid", HyperCommGrid), ("mcore: HyperCommGrid", MCoreGrid)):
        grid = cls([2, 2], ["tp", "dp"])
        made = [grid.create_pg(dims) for dims in ("tp", "dp", ["tp", "dp"])]
        out[name] = _outcome(lambda grid=grid: verify_groups(grid, **CFG))
        if isinstance(grid, HyperCommGrid):
            grid.destroy()
        else:  # MCore 0.16's grid has no destroy
            for group in made:
                dist.destroy_process_group(group)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh["dp", "tp"]._flatten("dp_tp")
    out["DeviceMesh"] = _outcome(lambda: verify_groups(mesh, **CFG))
    _destroy_mesh(mesh)
    return out


# --------------------------------------------------------------------------- one mistake each
def _traps() -> dict[str, dict[str, Any]]:
    """Collections with one deliberate mistake each (and a mesh laid out in another order)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed.device_mesh import init_device_mesh

    from parallel_state_ng import build_megatron_groups, verify_groups

    out = {}
    with _ours_collection() as ours, build_megatron_groups(**CFG, order="dp-tp-cp-ep-pp") as other:
        good = ours.field_values()

        def hand(**changes: Any) -> ProcessGroupCollection:
            return ProcessGroupCollection(**{**good, **changes})

        out["None field"] = _outcome(lambda: verify_groups(hand(mp=None), **CFG))
        out["missing field"] = _outcome(
            lambda: verify_groups(ProcessGroupCollection(tp=good["tp"], dp=good["dp"], pp=good["pp"]), **CFG)
        )
        out["whole-world field"] = _outcome(lambda: verify_groups(hand(mp=dist.group.WORLD), **CFG))
        out["group from another layout"] = _outcome(lambda: verify_groups(hand(tp=other.group("tp")), **CFG))
        out["group where MCore has none"] = _outcome(lambda: verify_groups(hand(inter_dist_opt=good["dp"]), **CFG))
        out["raise_as"] = _outcome(lambda: verify_groups(hand(mp=None), raise_as=AssertionError, **CFG))
        out["fields= skips the rest"] = _outcome(
            lambda: verify_groups(hand(mp=None), fields=["tp", "dp", "dp_cp"], **CFG)
        )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # tp varies slowest: another order
    out["mesh in another order"] = _outcome(lambda: verify_groups(mesh, **CFG))
    _destroy_mesh(mesh)
    return out


# --------------------------------------------------------------------------- bad input
def _bad_inputs() -> dict[str, dict[str, Any]]:
    """Every bad input, each raised on every rank (one world.run for the whole table)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel_state_ng import verify_groups

    rank = dist.get_rank()
    out = {}
    firsts = dist.new_group([0, 1])  # ranks 2 and 3 are not in it
    with _ours_collection() as ours:
        values = ours.field_values()
        out["collection whose group this rank is not in"] = _outcome(
            lambda: verify_groups({**values, "tp": firsts}, **CFG)
        )
        out["ranks disagreeing on the configuration"] = _outcome(
            lambda: verify_groups(values, **{**CFG, "context_parallel_size": 2 if rank == 3 else 1})
        )
        out["unknown field name in fields="] = _outcome(lambda: verify_groups(values, fields=["tq"], **CFG))
        out["unknown field name in the source"] = _outcome(lambda: verify_groups({**values, "tq": None}, **CFG))
        out["unknown configuration argument"] = _outcome(lambda: verify_groups(values, tensor_parallel=2))
        out["impossible configuration"] = _outcome(lambda: verify_groups(values, tensor_model_parallel_size=3))
        out["wrong type of source"] = _outcome(lambda: verify_groups(42, **CFG))
        out["a field that is no group"] = _outcome(lambda: verify_groups({**values, "tp": "tp"}, **CFG))
        out["raise_as that is no exception"] = _outcome(lambda: verify_groups(values, raise_as="boom", **CFG))
        out["unsupported release"] = _outcome(lambda: verify_groups(values, release="0.99", **CFG))
        out["bad input on one rank only"] = _outcome(
            lambda: verify_groups(values, fields=["tq"] if rank == 1 else None, **CFG)
        )
    unnamed = init_device_mesh("cpu", (2, 2))
    out["DeviceMesh without dim names"] = _outcome(lambda: verify_groups(unnamed, **CFG))
    for dim in range(2):
        dist.destroy_process_group(unnamed.get_group(dim))  # its 2 x 2 dims are not WORLD
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
    out["DeviceMesh dim that is no Megatron dim"] = _outcome(lambda: verify_groups(named, **CFG))
    out["dim_kinds naming no kind"] = _outcome(lambda: verify_groups(named, dim_kinds={"shard": "tensor"}, **CFG))
    _destroy_mesh(named)
    if rank in (0, 1):
        dist.destroy_process_group(firsts)
    return out


def _run_all() -> dict[str, dict[str, dict[str, Any]]]:
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    return {"good": _good_sources(), "traps": _traps(), "bad": _bad_inputs()}


@pytest.fixture(scope="module")
def results(gloo_world) -> list[dict[str, dict[str, dict[str, Any]]]]:
    pytest.importorskip("megatron.core.process_groups_config")
    # the table's sources and traps are collections; releases without one: test_verify_fake.py
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    return gloo_world(4).run(_run_all, timeout=240)


GOOD = [
    "ours: MegatronGroups",
    "ours: collection",
    "compat: parallel_state",
    "compat: pg_collection",
    "compat.verify_groups",
    "mcore: parallel_state",
    "mcore: use_mpu_process_groups",
    "ours: HyperCommGrid",
    "mcore: HyperCommGrid",
    "DeviceMesh",
]


@pytest.mark.parametrize("source", GOOD)
def test_a_source_built_right_passes_on_every_rank(source, results):
    for by_rank in results:
        got = by_rank["good"][source]
        assert got.get("ok") is True, got
        assert got["checked"] >= 3 * 4 and "ok," in got["text"]


# (scenario, the (where, trap) found on every rank, what the message says)
TRAPS = [
    ("None field", [("field 'mp'", "none")], r"field 'mp' \(kind 'mp'\) is None, but MCore's layout puts"),
    ("missing field", [("field 'mp'", "missing")], r"field 'mp' \(kind 'mp'\) is missing \(not set\)"),
    ("whole-world field", [("field 'mp'", "whole_world")], r"holds the whole world \[0, 1, 2, 3\].*sqrt\(2\)"),
    (
        "group from another layout",
        [("field 'tp'", "other_layout")],
        r"field 'tp' \(kind 'tp'\) holds group \[\d, \d\], but this layout's group for the rank is \[\d, \d\]; "
        r"that is this layout's 'dp' group and the 'tp' group under order='dp-cp-ep-tp-pp'",
    ),
    ("group where MCore has none", [("field 'inter_dist_opt'", "unexpected")], r"MCore's layout has no such group"),
    (
        "mesh in another order",
        [("mesh dim 'dp'", "other_layout"), ("mesh dim 'tp'", "other_layout")],
        r"mesh dim 'tp' \(kind 'tp'\) holds group .* that is this layout's 'dp' group",
    ),
]


@pytest.mark.parametrize("scenario,expected,message", TRAPS, ids=[t[0] for t in TRAPS])
def test_each_trap_is_named_on_the_right_field(scenario, expected, message, results):
    for by_rank in results:
        got = by_rank["traps"][scenario]
        assert got["ok"] is False
        world_findings = {(where, trap) for _, where, trap in got["findings"]}
        assert set(expected) <= world_findings, got["findings"]
        assert {r for r, _, _ in got["findings"]} == {0, 1, 2, 3}  # every rank's finding, on every rank
        assert re.search(message, got["text"]), got["text"]
    assert results[0]["traps"]["None field"]["text"] == results[3]["traps"]["None field"]["text"]


def test_raise_as_and_fields(results):
    for by_rank in results:
        raised = by_rank["traps"]["raise_as"]
        assert raised["error"] == "AssertionError" and "field 'mp' (kind 'mp') is None" in raised["message"]
        only = by_rank["traps"]["fields= skips the rest"]
        assert only["ok"] is True and only["checked"] == 3 * 4


# (case, exception type on every rank, what the message must name)
BAD_INPUTS = [
    ("collection whose group this rank is not in", "GroupMembershipError", r"rank 2: field 'tp'.*rank 3: field 'tp'"),
    (
        "ranks disagreeing on the configuration",
        "StatedConfigMismatchError",
        r"2 different configurations .* differ in context_parallel_size:\n"
        r"  ranks 0-2: \{\"context_parallel_size\":1,.*\n  rank 3: \{\"context_parallel_size\":2,",
    ),
    ("unknown field name in fields=", "ValueError", r"fields names \['tq'\]"),
    ("unknown field name in the source", "ValueError", r"field name\(s\) \['tq'\] that no ProcessGroupCollection"),
    ("unknown configuration argument", "TypeError", r"unknown configuration argument\(s\) \['tensor_parallel'\]"),
    (
        "impossible configuration",
        "RuntimeError",
        r"world_size \(4\) is not divisible by tensor_model_parallel_size \(3\)",
    ),
    ("wrong type of source", "TypeError", r"source must be a ProcessGroupCollection.*got builtins\.int"),
    ("a field that is no group", "TypeError", r"field 'tp' holds a str \('tp'\), not a process group"),
    ("raise_as that is no exception", "TypeError", r"raise_as must be an exception class, got 'boom'"),
    ("unsupported release", "ValueError", r"0\.99"),
    (
        "bad input on one rank only",
        "ValueError",
        r"(verify_groups failed on rank 1: ValueError: )?fields names \['tq'\]",
    ),
    ("DeviceMesh without dim names", "ValueError", r"DeviceMesh without dim names \(mesh_dim_names=None"),
    ("DeviceMesh dim that is no Megatron dim", "ValueError", r"dim 'shard' \(dims \['shard'\]\) matches no dense"),
    (
        "dim_kinds naming no kind",
        "ValueError",
        r"dim_kinds must map dim names to group kinds; unknown kind\(s\) \['tensor'\]",
    ),
]


@pytest.mark.parametrize("case,error,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_on_every_rank(case, error, message, results):
    for by_rank in results:
        got = by_rank["bad"][case]
        assert got.get("error") == error, got
        assert re.search(message, got["message"], re.S), got["message"]


# --------------------------------------------------------------------------- 8 ranks: tp 2, pp 2, dp 2
CFG8: dict[str, Any] = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}


def _eight() -> dict[str, dict[str, Any]]:
    """Ours, compat's and a DeviceMesh on 8 ranks, then two by-hand mistakes (no megatron import)."""
    from parallel_state_ng import build_megatron_groups, verify_groups

    out = {}
    with build_megatron_groups(**CFG8) as ours:
        out["ours"] = _outcome(lambda: verify_groups(ours, **CFG8))
        good = ours.field_values()  # empty before 0.15 (no collection): no by-hand collection then
        if good:
            out["mp = WORLD"] = _outcome(lambda: verify_groups({**good, "mp": dist.group.WORLD}, **CFG8))
            out["pos_embd = pp"] = _outcome(lambda: verify_groups({**good, "pos_embd": good["pp"]}, **CFG8))
    return out | _eight_without_mistakes()


def _eight_without_mistakes() -> dict[str, dict[str, Any]]:
    """The compat module and a DeviceMesh with a flattened dim on 8 ranks (every release)."""
    from torch.distributed.device_mesh import init_device_mesh

    import compat.parallel_state as cps
    from parallel_state_ng import verify_groups

    out = {}
    cps.initialize_model_parallel(**CFG8)
    try:
        out["compat"] = _outcome(lambda: verify_groups(cps, **CFG8))
    finally:
        cps.destroy_model_parallel()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    mesh["dp", "tp"]._flatten("dp_tp")
    out["DeviceMesh"] = _outcome(lambda: verify_groups(mesh, **CFG8))
    _destroy_mesh(mesh)
    return out


def test_eight_ranks(gloo_world):
    results = gloo_world(8).run(_eight)
    for by_rank in results:
        for name in ("ours", "compat", "DeviceMesh"):  # a raised error is a failure that names it
            assert by_rank[name].get("ok") is True, f"{name}: {by_rank[name]}"
        if not has_collection():  # the by-hand mistakes are collections (0.15 on)
            assert "mp = WORLD" not in by_rank
            continue
        world = by_rank["mp = WORLD"]
        assert world["findings"] == [(r, "field 'mp'", "whole_world") for r in range(8)]
        assert (
            "rank 5: field 'mp' (kind 'mp') holds the whole world [0, 1, 2, 3, 4, 5, 6, 7] instead of group"
            in (world["text"])
        )
        # first stage: the position embedding is the rank alone; last stage: it has none
        stages = {r: "other_layout" if r < 4 else "unexpected" for r in range(8)}
        assert by_rank["pos_embd = pp"]["findings"] == [(r, "field 'pos_embd'", stages[r]) for r in range(8)]


def test_no_default_group_is_a_clear_error(monkeypatch):
    from parallel_state_ng import verify_groups

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"verify_groups needs torch.distributed: no default group"):
        verify_groups({}, **CFG)
