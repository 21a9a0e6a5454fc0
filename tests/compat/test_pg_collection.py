"""``compat.pg_collection.to_process_group_collection`` against megatron-core.

* Fake backend, several configurations and ranks: the exported collection's fields hold the
  same ranks (or ``None``) as ``ProcessGroupCollection.use_mpu_process_groups()`` with MCore's
  own ``parallel_state`` initialized the same way; ``required_pgs`` and the errors behave.
* Gloo world of 4: every field is the very object compat's module globals hold (MCore's
  field <-> global pairing), and an all-reduce over it sums its members.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.layout.kinds import fills
from tests.support.paths import ROOT
from tests.support.served import has_collection, skip_unless

# Worker processes import this module: no megatron at module level.


def _ranks(value):
    """Comparable form of a field value: None, a rank list, or a list of rank lists."""
    if value is None:
        return None
    if isinstance(value, list):
        return [_ranks(v) for v in value]
    return dist.get_process_group_ranks(value)


def _snapshot(collection) -> dict:
    return {f.name: _ranks(getattr(collection, f.name)) for f in dataclasses.fields(collection)}


CONFIGS = [
    (8, {}),
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    (8, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}),
    (
        8,
        {
            "tensor_model_parallel_size": 2,
            "expert_model_parallel_size": 4,
            "expert_tensor_parallel_size": 1,
            "num_distributed_optimizer_instances": 2,
        },
    ),
    (16, {"pipeline_model_parallel_size": 4, "tensor_model_parallel_size": 2, "order": "tp-cp-ep-pp-dp"}),
    (
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "num_distributed_optimizer_instances": 2,
            "context_parallel_size": 2,
        },
    ),
]


def _ranks_to_check(world: int) -> list[int]:
    return sorted({0, 1, world // 2 - 1, world // 2 + 1, world - 1})


@pytest.mark.parametrize("world,kwargs", CONFIGS, ids=[f"w{w}-{i}" for i, (w, _) in enumerate(CONFIGS)])
def test_fields_equal_mcore_use_mpu_process_groups(world, kwargs, fake_world, monkeypatch):
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    mcore_ps = pytest.importorskip("megatron.core.parallel_state")
    from megatron.core.process_groups_config import ProcessGroupCollection

    import compat
    import compat.parallel_state as compat_ps
    from compat.pg_collection import to_process_group_collection

    assert not compat.is_installed()
    kwargs = dict(kwargs, create_gloo_process_groups=False)
    for rank in _ranks_to_check(world):
        fake_world(rank, world)
        # MCore's destroy_model_parallel leaves _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS set, so a
        # config without hierarchical cp would report the previous config's (destroyed) groups
        # as ``hcp``; start MCore from a fresh process's value.
        monkeypatch.setattr(mcore_ps, "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcore_ps.initialize_model_parallel(**kwargs)
        try:
            reference = _snapshot(ProcessGroupCollection.use_mpu_process_groups())
        finally:
            mcore_ps.destroy_model_parallel()
        compat_ps.initialize_model_parallel(**kwargs)
        try:
            ours = to_process_group_collection()
            explicit = to_process_group_collection(compat_ps.get_state())
            assert _snapshot(ours) == reference, f"rank {rank}"
            assert _snapshot(explicit) == reference
            assert set(reference) == {f.name for f in dataclasses.fields(ProcessGroupCollection)}
        finally:
            compat_ps.destroy_model_parallel()


def test_required_pgs_and_errors(fake_world, monkeypatch):
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    pytest.importorskip("megatron.core.process_groups_config")
    import megatron.core.process_groups_config as pgc_module

    import compat.parallel_state as compat_ps
    from compat.pg_collection import UnknownCollectionFieldError, to_process_group_collection

    fake_world(3, 8)
    with pytest.raises(AssertionError, match="not initialized"):
        to_process_group_collection()  # like MCore's use_mpu_process_groups before init
    compat_ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    try:
        some = to_process_group_collection(required_pgs=["tp", "dp"])
        assert some.tp is compat_ps.get_tensor_model_parallel_group()
        assert some.dp is compat_ps.get_data_parallel_group()
        # unset, as MCore leaves fields not asked for (0.19's class reads an unset field as None)
        assert "pp" not in vars(some) and getattr(some, "pp", None) is None
        with pytest.raises(ValueError, match="nope"):
            to_process_group_collection(required_pgs=["tp", "nope"])

        @dataclasses.dataclass
        class NewerCollection(pgc_module.ProcessGroupCollection):
            brand_new: object = dataclasses.field(init=False)

        monkeypatch.setattr(pgc_module, "ProcessGroupCollection", NewerCollection)
        with pytest.raises(UnknownCollectionFieldError, match="brand_new"):
            to_process_group_collection()
    finally:
        compat_ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_importing_pg_collection_does_not_import_megatron():
    root = ROOT
    code = "import sys, compat.pg_collection\nprint(any(m.split('.')[0] == 'megatron' for m in sys.modules))\n"
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------------------- gloo world
# Field -> the module global MCore's ProcessGroupCollection pairs it with: the kind table's
# pairing (0.19 adds the GTP fields). The all-gather fields (0.18+) have none: MCore's
# use_mpu_process_groups() leaves them None.
FIELD_GLOBALS = {fill.collection: fill.name for _kind, fill in fills() if fill.collection}


def _export_on_gloo(configs):
    import compat.parallel_state as ps
    from compat.pg_collection import to_process_group_collection

    rank = dist.get_rank()
    out = []
    for kwargs in configs:
        ps.initialize_model_parallel(**kwargs)
        try:
            collection = to_process_group_collection()
            fields = [f.name for f in dataclasses.fields(collection)]
            same = {
                name: getattr(collection, name) is (getattr(ps, FIELD_GLOBALS[name]) if name in FIELD_GLOBALS else None)
                for name in fields
            }
            sums = {}
            for name in fields:
                value = getattr(collection, name)
                for i, group in enumerate(value if isinstance(value, list) else [value]):
                    if group is None:
                        continue
                    t = torch.tensor([rank], dtype=torch.int64)
                    dist.all_reduce(t, group=group)
                    sums[f"{name}{i}"] = (int(t.item()), sum(dist.get_process_group_ranks(group)))
            out.append((same, sums))
        finally:
            ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_gloo_fields_are_compat_groups(gloo_world):
    skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    pytest.importorskip("megatron.core.process_groups_config")
    configs = [
        {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        {
            "context_parallel_size": 2,
            "hierarchical_context_parallel_sizes": [2],
            "num_distributed_optimizer_instances": 2,
        },
    ]
    results = gloo_world(4).run(_export_on_gloo, configs, timeout=300)
    for rank, per_config in enumerate(results):
        for kwargs, (same, sums) in zip(configs, per_config):
            assert same and all(same.values()), (rank, kwargs, same)
            assert sums and all(got == want for got, want in sums.values()), (rank, kwargs, sums)
