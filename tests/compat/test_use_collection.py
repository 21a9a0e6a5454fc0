"""``compat.use_collection(pgc)``: a ``ProcessGroupCollection`` served as compat's globals, strictly.

* Fake backend: a collection from ``build_megatron_groups`` served through the getters shows
  what compat's own ``initialize_model_parallel`` shows (rank lists, sizes and ranks per getter)
  for several layouts and orders, with the collection's very group objects; MCore's own
  collection (``use_mpu_process_groups()``) likewise; the layout is inferred at 65,536 ranks
  with no enumeration of the world; a missing field's getter raises; a table of bad inputs;
  the previous state is restored after exit, after an exception and across nested scopes.
* Gloo world of 4: all-reduces over the served groups (ours, and MCore's after its own init);
  ranks passing different collections, or one rank passing an inconsistent one, all raise
  (none hangs).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng import build_megatron_groups
from parallel_state_ng.groups.agreement_protocol import ParallelConfigMismatchError
from parallel_state_ng.layout.from_groups import InconsistentCollectionError, infer_layout
from tests.support.served import has_collection, served

pytestmark = pytest.mark.skipif(
    not has_collection(), reason=f"megatron-core {served()} has no ProcessGroupCollection (it came in 0.15)"
)

# Worker processes import this module: no megatron at module level.

#: field -> (getter, keyword arguments) that serves it.
GETTERS = {
    "tp": ("get_tensor_model_parallel_group", {}),
    "pp": ("get_pipeline_model_parallel_group", {}),
    "mp": ("get_model_parallel_group", {}),
    "cp": ("get_context_parallel_group", {}),
    "tp_cp": ("get_tensor_and_context_parallel_group", {}),
    "dp": ("get_data_parallel_group", {}),
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "intra_dp_cp": ("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}),
    "tp_dp_cp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    "ep": ("get_expert_model_parallel_group", {}),
    "expt_tp": ("get_expert_tensor_parallel_group", {}),
    "tp_ep": ("get_expert_tensor_and_model_parallel_group", {}),
    "tp_ep_pp": ("get_expert_tensor_model_pipeline_parallel_group", {}),
    "expt_dp": ("get_expert_data_parallel_group", {}),
    "embd": ("get_embedding_group", {}),
    "pos_embd": ("get_position_embedding_group", {}),
    "intra_dist_opt": ("get_intra_distributed_optimizer_instance_group", {}),
}
SIZE_GETTERS = [
    f"get_{what}_{part}"
    for what in (
        "tensor_model_parallel",
        "pipeline_model_parallel",
        "data_parallel",
        "context_parallel",
        "expert_model_parallel",
        "expert_tensor_parallel",
        "expert_data_parallel",
    )
    for part in ("world_size", "rank")
]

LAYOUTS = [
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "order": "tp-pp-dp"}),
    (
        16,
        {
            "tensor_model_parallel_size": 2,
            "context_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "hierarchical_context_parallel_sizes": [2],
            "order": "tp-dp-cp-pp",
        },
    ),
    (
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
            "num_distributed_optimizer_instances": 2,
        },
    ),
]


def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _view(ps) -> dict:
    """What the getters show: each group getter's rank list (or its exception type), each size/rank."""
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for field, (name, kwargs) in GETTERS.items():
            try:
                out[field] = _ranks(getattr(ps, name)(**kwargs))
            except (AssertionError, RuntimeError) as exc:
                out[field] = type(exc).__name__
        for name in SIZE_GETTERS:
            out[name] = getattr(ps, name)()
        levels = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
        out["hcp"] = None if levels is None else [_ranks(g) for g in levels]
        out["_PIPELINE_GLOBAL_RANKS"] = ps._PIPELINE_GLOBAL_RANKS
    return out


def _identical(ps, pgc) -> list[str]:
    """Fields whose getter does not return the collection's very object."""
    wrong = []
    for field, (name, kwargs) in GETTERS.items():
        value = getattr(pgc, field, None)
        if value is not None and getattr(ps, name)(**kwargs) is not value:
            wrong.append(field)
    return wrong


def _module_state(ps) -> dict:
    """Every global a scope may change, the active state and the detached states."""
    from compat import _scoping
    from compat._publish import BLOCK_OVERRIDES, STATE_EXTRAS, state_globals

    ns = vars(ps)
    names = [*state_globals(ns), *BLOCK_OVERRIDES, *STATE_EXTRAS]
    return {
        "globals": {n: ns.get(n) for n in names},
        "active": ps.get_state(),
        "detached": dict(_scoping._DETACHED),
        "suspended": list(_scoping._SUSPENDED),
    }


def _same_state(before: dict, after: dict) -> None:
    assert after["active"] is before["active"]
    assert after["detached"].keys() == before["detached"].keys()
    assert after["suspended"] == before["suspended"]
    changed = [n for n, v in before["globals"].items() if after["globals"][n] is not v and after["globals"][n] != v]
    assert not changed, changed


@pytest.mark.parametrize("world,kwargs", LAYOUTS, ids=[f"w{w}-{i}" for i, (w, _) in enumerate(LAYOUTS)])
def test_served_collection_equals_compat_init(world, kwargs, fake_world):
    import compat.parallel_state as ps

    for rank in sorted({0, world // 2 + 1, world - 1}):
        fake_world(rank, world)
        ps.initialize_model_parallel(**kwargs, create_gloo_process_groups=False)
        reference = _view(ps)
        ps.destroy_model_parallel()
        with build_megatron_groups(**kwargs) as groups:
            pgc = groups.collection()
            with ps.use_collection(pgc) as state:
                assert _view(ps) == reference, f"rank {rank}"
                assert _identical(ps, pgc) == [], f"rank {rank}"
                assert state.layout.tensor_model_parallel_size == kwargs["tensor_model_parallel_size"]
            assert not ps.model_parallel_is_initialized()


def test_mcore_collection_is_served(fake_world, monkeypatch):
    mcore_ps = pytest.importorskip("megatron.core.parallel_state")
    from megatron.core.process_groups_config import ProcessGroupCollection

    import compat
    import compat.parallel_state as ps

    assert not compat.is_installed()
    # MCore's destroy_model_parallel leaves some globals set (_EMBEDDING_GLOBAL_RANKS, ...):
    # every module global goes back to its value before this test.
    for name, value in list(vars(mcore_ps).items()):
        if name.startswith("_") and name.strip("_").replace("_", "").isupper():
            monkeypatch.setattr(mcore_ps, name, value)
    for world, kwargs in LAYOUTS[:2] + LAYOUTS[3:]:
        for rank in (1, world - 2):
            fake_world(rank, world)
            monkeypatch.setattr(mcore_ps, "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mcore_ps.initialize_model_parallel(**kwargs, create_gloo_process_groups=False)
            try:
                pgc = ProcessGroupCollection.use_mpu_process_groups()
                mcore_view = _view(mcore_ps)
                with ps.use_collection(pgc):
                    served = _view(ps)
                    assert _identical(ps, pgc) == []
            finally:
                mcore_ps.destroy_model_parallel()
            # MCore answers every getter from its globals; the collection holds only the fields
            # use_mpu_process_groups() fills: those agree, the rest raise here (no stand-in).
            for key, value in served.items():
                assert value == mcore_view[key] or (key == "tp_dp_cp" and value == "AssertionError"), (key, rank)


def test_inference_at_65536_ranks_enumerates_no_group_of_the_world(fake_world, monkeypatch):
    import compat.parallel_state as ps
    from parallel_state_ng.layout.megatron_layout import MegatronLayout
    from parallel_state_ng.layout.named_layout import Layout

    def refuse(*args, **kwargs):
        raise AssertionError("enumerated every group of the world")

    fake_world(40_000, 65_536)
    kwargs = {
        "tensor_model_parallel_size": 8,
        "pipeline_model_parallel_size": 8,
        "context_parallel_size": 2,
        "expert_model_parallel_size": 8,
        "order": "cp-tp-ep-dp-pp",
    }
    with build_megatron_groups(**kwargs) as groups:
        monkeypatch.setattr(MegatronLayout, "enumerate", refuse)
        monkeypatch.setattr(Layout, "rank_enum", refuse)
        with ps.use_collection(groups.collection()) as state:
            assert state.layout.order == "cp-tp-ep-dp-pp"
            assert ps.get_data_parallel_world_size() == 512
            assert ps.get_expert_data_parallel_world_size() == 128
            assert ps._PIPELINE_GLOBAL_RANKS == groups.ranks("pp")


def test_a_missing_field_raises_and_nothing_stands_in(fake_world):
    import compat.parallel_state as ps

    fake_world(3, 8)
    with build_megatron_groups(tensor_model_parallel_size=2, context_parallel_size=2) as groups:
        pgc = copy.copy(groups.collection())
        pgc.cp = None
        del pgc.intra_dp_cp  # absent, not None
        with ps.use_collection(pgc):
            with pytest.raises(AssertionError, match="context parallel group is not initialized"):
                ps.get_context_parallel_group()
            with pytest.raises(AssertionError):
                ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            with pytest.raises(AssertionError):  # no field holds it: not tp_dp_cp in its place
                ps.get_tensor_and_data_parallel_group()
            with pytest.raises(AssertionError):  # no gloo twin in a collection
                ps.get_data_parallel_group_gloo()
            assert ps.get_context_parallel_group(check_initialized=False) is None
            assert ps.get_data_parallel_group(with_context_parallel=True) is pgc.dp_cp
            assert ps.get_tensor_and_context_parallel_world_size() == 4


def test_restored_after_exit_exception_and_nesting(fake_world):
    import compat.parallel_state as ps

    fake_world(2, 8)
    ps.initialize_model_parallel(tensor_model_parallel_size=4, create_gloo_process_groups=False)
    ps.set_virtual_pipeline_model_parallel_world_size(3)
    ps.set_tensor_model_parallel_world_size(7)  # an override, dropped inside a scope
    try:
        outer_grid = ps.get_state()
        before = _module_state(ps)
        with (
            build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2) as a,
            build_megatron_groups(pipeline_model_parallel_size=4) as b,
        ):
            with ps.use_collection(a.collection()):
                assert ps.get_tensor_model_parallel_world_size() == 2
                assert ps.get_virtual_pipeline_model_parallel_world_size() is None
                inner_before = _module_state(ps)
                with ps.use_collection(b.collection()):
                    assert ps.get_pipeline_model_parallel_world_size() == 4
                    assert ps.get_tensor_model_parallel_world_size() == 1
                _same_state(inner_before, _module_state(ps))
            _same_state(before, _module_state(ps))
            with pytest.raises(ZeroDivisionError), ps.use_collection(a.collection()):
                assert ps.get_pipeline_model_parallel_world_size() == 2
                raise ZeroDivisionError
            _same_state(before, _module_state(ps))
        assert ps.get_state() is outer_grid and ps.get_tensor_model_parallel_world_size() == 7
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 3
    finally:
        ps.destroy_model_parallel()


@dataclasses.dataclass
class _Extended:
    tp: object = None
    zz_new_field: object = None


def _swap(pgc, a, b):
    x, y = getattr(pgc, a), getattr(pgc, b)
    setattr(pgc, a, y)
    setattr(pgc, b, x)


# (name, how the rank-5 collection of tp2 pp2 on 8 ranks is spoiled, exception, message)
BAD_COLLECTIONS = [
    ("tp and pp swapped", lambda p, o: _swap(p, "tp", "pp"), InconsistentCollectionError, "(?s)field 'tp'.*field 'pp'"),
    ("mp is the tp group", lambda p, o: setattr(p, "mp", p.tp), InconsistentCollectionError, "'mp' has 2 ranks"),
    ("tp of another layout", lambda p, o: setattr(p, "tp", o.tp), InconsistentCollectionError, r"(?s)tp=4.*tp\(4\)"),
    ("dp is the world", lambda p, o: setattr(p, "dp", dist.group.WORLD), InconsistentCollectionError, r"(?s)dp=8.*dp\(8\)"),
    ("dp and dp_cp of another layout", lambda p, o: (setattr(p, "dp", o.dp), setattr(p, "dp_cp", o.dp_cp)),
     InconsistentCollectionError, "(?s)dp=1.*not the world size 8"),
    ("a group this rank is not in", lambda p, o: setattr(p, "tp", dist.GroupMember.NON_GROUP_MEMBER),
     InconsistentCollectionError, "not a member"),
    ("not a process group", lambda p, o: setattr(p, "cp", "cp-group"), InconsistentCollectionError,
     "field 'cp' holds 'cp-group', which is no process group"),
    ("hcp not a list", lambda p, o: setattr(p, "hcp", p.cp), InconsistentCollectionError, "'hcp' must be a list"),
]  # fmt: skip


@pytest.mark.parametrize("name,spoil,error,match", BAD_COLLECTIONS, ids=[c[0] for c in BAD_COLLECTIONS])
def test_bad_collections_are_refused(name, spoil, error, match, fake_world):
    import compat.parallel_state as ps

    fake_world(5, 8)
    with (
        build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2) as groups,
        build_megatron_groups(tensor_model_parallel_size=4, context_parallel_size=2) as other,
    ):
        pgc = copy.copy(groups.collection())
        spoil(pgc, other.collection())
        before = _module_state(ps)
        with pytest.raises(error, match=match), ps.use_collection(pgc):
            pass
        _same_state(before, _module_state(ps))


def test_bad_arguments_and_groups_of_other_worlds(fake_world):
    import compat.parallel_state as ps

    with pytest.raises(TypeError, match="needs torch.distributed to be initialized"), ps.use_collection(object()):
        pass
    fake_world(0, 8)
    with pytest.raises(TypeError, match="pgc must be a ProcessGroupCollection"), ps.use_collection(None):
        pass
    with pytest.raises(InconsistentCollectionError, match=r"\['zz_new_field'\]"), ps.use_collection(_Extended()):
        pass
    with build_megatron_groups(tensor_model_parallel_size=2) as groups:
        stale = groups.collection()
    with pytest.raises(InconsistentCollectionError, match="field 'tp' .* no process group of this"):
        with ps.use_collection(stale):  # destroyed with its groups
            pass
    # member lists as another world gives them (the per-rank inference, no groups needed)
    tp2 = {"tp": [0, 1], "pp": [0, 4], "dp": [0, 2]}
    with pytest.raises(InconsistentCollectionError, match=r"'tp' holds ranks \[9\] outside the world \[0, 8\)"):
        infer_layout(0, 8, {**tp2, "tp": [0, 9]}, "0.16")
    with pytest.raises(InconsistentCollectionError, match=r"'dp' repeats ranks"):
        infer_layout(0, 8, {**tp2, "dp": [0, 0]}, "0.16")
    with pytest.raises(InconsistentCollectionError, match="'pp' does not hold this rank 0"):
        infer_layout(0, 8, {**tp2, "pp": [1, 5]}, "0.16")
    with pytest.raises(InconsistentCollectionError, match=r"tp\(2\) x gtp\(1\) x pp\(4\) x cp\(1\) x dp\(2\) = 16"):
        infer_layout(0, 8, {**tp2, "pp": [0, 2, 4, 6]}, "0.16")  # a 16-rank world's pipeline
    with pytest.raises(InconsistentCollectionError, match="cannot tell the size"):
        infer_layout(0, 8, {"tp": [0, 1]}, "0.16")
    with pytest.raises(InconsistentCollectionError, match="'embd'"):
        infer_layout(0, 8, {**tp2, "embd": [0, 2]}, "0.16")
    with pytest.raises(KeyError, match="unknown ProcessGroupCollection field"):
        infer_layout(0, 8, {**tp2, "tensor": [0, 1]}, "0.16")


# ----------------------------------------------------------------------------------- gloo


def _gloo_rounds(spoil_rank: int) -> dict:
    import compat.parallel_state as ps

    rank = dist.get_rank()
    out: dict = {}
    with (
        build_megatron_groups(tensor_model_parallel_size=2) as a,
        build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2) as b,
    ):
        with ps.use_collection(a.collection()):
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
            y = torch.tensor([float(rank)])
            dist.all_reduce(y, group=ps.get_data_parallel_group())
            out["sums"] = (x.item(), y.item(), ps.get_data_parallel_rank())
        mine = a.collection() if rank < 2 else b.collection()  # two layouts across the ranks
        try:
            with ps.use_collection(mine):
                pass
        except (ParallelConfigMismatchError, InconsistentCollectionError) as exc:
            out["different"] = type(exc).__name__
        spoiled = a.collection()
        if rank == spoil_rank:
            spoiled.tp_dp_cp = spoiled.tp  # 2 ranks where tp x dp = 4
        try:
            with ps.use_collection(spoiled):
                pass
        except (ParallelConfigMismatchError, InconsistentCollectionError) as exc:
            out["spoiled"] = type(exc).__name__
        out["initialized"] = ps.model_parallel_is_initialized()
    out["mcore"] = _mcore_collection_on_gloo()
    return out


def _mcore_collection_on_gloo() -> tuple:
    """MCore's own init (tp 2) and ``use_mpu_process_groups()``, served: sums over compat's getters."""
    import megatron.core.parallel_state as mcore_ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    import compat.parallel_state as ps

    pristine = {
        n: v for n, v in vars(mcore_ps).items() if n.startswith("_") and n.strip("_").replace("_", "").isupper()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcore_ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        with ps.use_collection(pgc):
            x = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
            same = ps.get_data_parallel_group() is mcore_ps.get_data_parallel_group()
        return x.item(), same
    finally:
        mcore_ps.destroy_model_parallel()
        vars(mcore_ps).update(pristine)  # MCore's destroy leaves some globals set


def test_gloo_served_groups_reduce_and_disagreeing_ranks_all_raise(gloo_world):
    pytest.importorskip("megatron.core.process_groups_config")
    results = gloo_world(4).run(_gloo_rounds, 3, timeout=300)
    for rank, out in enumerate(results):
        tp = [rank - rank % 2, rank - rank % 2 + 1]
        dp = [rank % 2, rank % 2 + 2]
        assert out["sums"] == (float(sum(tp)), float(sum(dp)), rank // 2), rank
        assert out["different"] == "ParallelConfigMismatchError", rank
        assert out["spoiled"] == ("InconsistentCollectionError" if rank == 3 else "ParallelConfigMismatchError")
        assert out["initialized"] is False
        assert out["mcore"] == (float(sum(tp)), True), rank
