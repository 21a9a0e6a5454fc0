"""Several independent grids in one job: ``detach_state`` / ``use_state`` / ``destroy_state``.

Fake backend: two configurations over the same world; inside ``use_state(x)`` everything the
module shows (every getter with every argument combination and every module global, via
``tests/support/differential/library.py``'s snapshot) equals what it shows when ``x`` is the only grid, and the
other grid is untouched on exit (normal exit, exception, nesting); ``set_*`` overrides are per
block; a getter whose group the active grid lacks raises; destruction is complete.

Gloo world of 4: all-reduces inside each scope run over that grid's groups.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support import served

# Worker processes import this module: megatron (differential) is imported inside the tests.

PAIRS = [
    (
        8,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
            "hierarchical_context_parallel_sizes": [2],
            "create_all_gather_group": True,
        },
        {
            "tensor_model_parallel_size": 4,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
            "num_distributed_optimizer_instances": 2,
        },
    ),
    (
        16,
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1},
        {"pipeline_model_parallel_size": 4, "context_parallel_size": 2, "order": "tp-cp-ep-dp-pp"},
    ),
]


def _init(ps, config: dict) -> None:
    """Init ``config`` as the served release takes it: its all-gather group in init (0.16-0.17),
    after init (0.18+) or none (before 0.16).
    """
    served.initialize(ps, config, optional=("create_all_gather_group",))


def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _snap(D, ps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return D.snapshot(ps, dist.get_rank())


def _same(D, reference, other, what):
    diffs = D.compare(reference, other)
    assert not diffs, f"{what}:\n{D.describe(diffs)}"


@pytest.mark.parametrize("world,config_a,config_b", PAIRS, ids=["w8", "w16"])
def test_each_scope_sees_exactly_its_grid(world, config_a, config_b, fake_world):
    D = pytest.importorskip("tests.support.differential.library")
    import compat.parallel_state as ps

    config_a = dict(config_a, create_gloo_process_groups=False)
    config_b = dict(config_b, create_gloo_process_groups=False)
    for rank in (0, world // 2 + 1, world - 1):
        fake_world(rank, world)
        baseline = _live_groups()
        alone = {}
        for name, config in (("a", config_a), ("b", config_b)):
            _init(ps, config)
            alone[name] = _snap(D, ps)
            ps.destroy_model_parallel()
        empty = _snap(D, ps)

        _init(ps, config_a)
        a = ps.detach_state()
        _same(D, empty, _snap(D, ps), "after detach_state the module is uninitialized")
        _init(ps, config_b)
        b = ps.get_state()
        _same(D, alone["b"], _snap(D, ps), "grid b active")

        with ps.use_state(a) as entered:
            assert entered is a and ps.get_state() is a
            _same(D, alone["a"], _snap(D, ps), "inside use_state(a)")
            with ps.use_state(None):
                _same(D, empty, _snap(D, ps), "inside use_state(None)")
            with ps.use_state(b):
                _same(D, alone["b"], _snap(D, ps), "use_state(b) nested in use_state(a)")
            _same(D, alone["a"], _snap(D, ps), "back in use_state(a)")
        _same(D, alone["b"], _snap(D, ps), "after the block")

        with pytest.raises(KeyError, match="boom"):
            with ps.use_state(a):
                raise KeyError("boom")
        _same(D, alone["b"], _snap(D, ps), "after a block left by an exception")

        ps.destroy_state(a)
        assert _live_groups() == baseline + len(b.created)
        _same(D, alone["b"], _snap(D, ps), "after destroy_state(a)")
        ps.destroy_state(b)  # the active grid
        assert _live_groups() == baseline
        _same(D, empty, _snap(D, ps), "after destroy_state of the active grid")


def test_overrides_missing_groups_and_errors(fake_world):
    import compat.parallel_state as ps
    from compat.pg_collection import to_process_group_collection

    fake_world(3, 8)
    baseline = _live_groups()
    with pytest.raises(AssertionError, match="no parallel state to detach"):
        ps.detach_state()
    with pytest.raises(TypeError, match="ModelParallelGroups"):
        ps.destroy_state(None)

    # grid a: tp 2, pp 4 (rank 3 is a middle stage: no embedding), separate all-gather group
    # where the release has one (0.16-0.17 in init, read back through a getter; 0.18+ after init)
    _init(
        ps,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 4,
            "create_all_gather_group": True,
            "create_gloo_process_groups": False,
        },
    )
    a = ps.detach_state()
    # grid b: tp 1, pp 1 (every rank holds the embedding), no all-gather group
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    b = ps.get_state()
    all_gather_getter = hasattr(ps, "has_separate_all_gather_group")  # 0.16-0.17

    # a getter whose group the active grid lacks fails instead of answering for the other grid
    assert ps.get_embedding_group() is b.groups["embd"]
    if all_gather_getter:
        assert ps.has_separate_all_gather_group() is False
        with pytest.raises(AssertionError, match="not initialized"):
            ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    with ps.use_state(a):
        if "check_initialized" in inspect.signature(ps.get_embedding_group).parameters:  # not in 0.12
            assert ps.get_embedding_group(check_initialized=False) is None
        with pytest.raises(AssertionError, match="not initialized"):
            ps.get_embedding_group()
        assert not ps.is_rank_in_embedding_group()
        if all_gather_getter:
            group = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
            assert group is a.groups["dp_cp_ag"]
        with pytest.raises(AssertionError, match="not initialized"):
            ps.get_data_parallel_group_gloo()  # neither grid has gloo twins
    with ps.use_state(None):
        with pytest.raises(AssertionError, match="not initialized"):
            ps.get_tensor_model_parallel_group()
        assert not ps.is_initialized()

    # set_* overrides are per block
    ps.set_tensor_model_parallel_world_size(7)
    ps.set_data_parallel_rank(5)
    with ps.use_state(a):
        assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_data_parallel_rank() == 0
        ps.set_tensor_model_parallel_world_size(3)
        ps.set_expert_model_parallel_rank(4)
        with ps.use_state(a):
            assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_expert_model_parallel_rank() == 0
        assert ps.get_tensor_model_parallel_world_size() == 3 and ps.get_expert_model_parallel_rank() == 4
    assert ps.get_tensor_model_parallel_world_size() == 7 and ps.get_data_parallel_rank() == 5
    assert ps.get_expert_model_parallel_rank() == 0
    ps.set_tensor_model_parallel_world_size(None)
    ps.set_data_parallel_rank(None)

    # export of a grid that is not active leaves the active one alone (0.15+: a collection class)
    if served.has_collection():
        exported = to_process_group_collection(a)
        assert exported.tp is a.groups["tp"] and exported.embd is None
        assert ps.get_state() is b and ps.get_tensor_model_parallel_group() is b.groups["tp"]

    # a state an enclosing block restores cannot be destroyed inside it
    with ps.use_state(a):
        with ps.use_state(b):
            with pytest.raises(AssertionError, match="enclosing use_state"):
                ps.destroy_state(a)
    # a grid initialized inside a block and not detached there is reported on exit
    with pytest.warns(ResourceWarning, match="neither detached nor destroyed"):
        with ps.use_state(None):
            ps.initialize_model_parallel(create_gloo_process_groups=False)
            stray = ps.get_state()
    assert ps.get_state() is b
    for state in (stray, a, b, a):  # twice is harmless
        ps.destroy_state(state)
    assert _live_groups() == baseline and ps.get_state() is None


# --------------------------------------------------------------------------- gloo world
def _two_grids_on_gloo():
    import compat.parallel_state as ps
    from compat.pg_collection import to_process_group_collection

    rank = dist.get_rank()
    baseline = _live_groups()

    def total(group) -> int:
        t = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        return int(t.item())

    def observe() -> dict:
        tp = ps.get_tensor_model_parallel_group()
        dp = ps.get_data_parallel_group()
        seen = {
            "tp": (total(tp), dist.get_process_group_ranks(tp)),
            "dp": (total(dp), dist.get_process_group_ranks(dp)),
            "tp_size": ps.get_tensor_model_parallel_world_size(),
        }
        try:
            seen["dp_gloo"] = total(ps.get_data_parallel_group_gloo())
        except AssertionError:
            seen["dp_gloo"] = "missing"
        return seen

    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # with gloo twins
    vision = ps.detach_state()
    ps.initialize_model_parallel(tensor_model_parallel_size=4, create_gloo_process_groups=False)
    language = ps.detach_state()
    out: dict = {"rounds": []}
    try:
        for _ in range(2):  # switch back and forth
            with ps.use_state(vision):
                v = observe()
                with ps.use_state(language):
                    nested = observe()
                v_again = observe()
            with ps.use_state(language):
                lang = observe()
                if served.has_collection():  # 0.15+
                    lang["exported_tp"] = total(to_process_group_collection().tp)
            out["rounds"].append({"vision": v, "nested": nested, "vision_again": v_again, "language": lang})
        if served.has_collection():
            out["vision_export_tp"] = total(to_process_group_collection(vision).tp)
        out["outside_initialized"] = ps.is_initialized()
    finally:
        ps.destroy_state(vision)
        ps.destroy_state(language)
    out["leaked"] = _live_groups() - baseline
    return out


def test_gloo_all_reduce_inside_each_scope_hits_its_grid(gloo_world):
    results = gloo_world(4).run(_two_grids_on_gloo, timeout=300)
    for rank, out in enumerate(results):
        tp2 = [rank - rank % 2, rank - rank % 2 + 1]  # vision: tp 2, dp 2
        dp2 = [rank % 2, rank % 2 + 2]
        vision = {"tp": (sum(tp2), tp2), "dp": (sum(dp2), dp2), "tp_size": 2, "dp_gloo": sum(dp2)}
        language = {"tp": (6, [0, 1, 2, 3]), "dp": (rank, [rank]), "tp_size": 4, "dp_gloo": "missing"}
        for r in out["rounds"]:
            assert r["vision"] == vision and r["vision_again"] == vision, (rank, r)
            assert r["nested"] == language, (rank, r)
            exported = {"exported_tp": 6} if served.has_collection() else {}
            assert r["language"] == dict(language, **exported), (rank, r)
        assert out.get("vision_export_tp") == (sum(tp2) if served.has_collection() else None)
        assert out["outside_initialized"] is False
        assert out["leaked"] == 0
