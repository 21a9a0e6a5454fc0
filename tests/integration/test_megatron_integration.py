"""Megatron-Core itself running on ``compat.parallel_state`` (``compat.install()``), on gloo.

In every worker of a gloo world:

1. megatron is imported first, then ``compat.install()``: ``megatron.core.parallel_state`` (and
   ``megatron.core.mpu``, ``sys.modules``) is compat, and every name the tensor-parallel modules
   bound with ``from megatron.core.parallel_state import ...`` is compat's function; MCore's own
   module stays uninitialized while compat runs, so MCore code that still read it would fail.
2. Initialized through ``megatron.core.parallel_state.initialize_model_parallel``, megatron's
   tensor-parallel mappings (forward and backward, with and without the global memory buffer)
   and ``vocab_parallel_cross_entropy`` run on CPU tensors with deterministic inputs;
   ``ProcessGroupCollection.use_mpu_process_groups()`` returns compat's group objects.
3. ``compat.uninstall()`` gives MCore back (module, bound names); MCore's own parallel_state is
   initialized the same way and the same computations run: every number must be equal.

A second variant installs compat BEFORE megatron is imported; it needs workers that never
imported megatron, so it runs on a private 2-rank world.

The gather functions allocate on ``torch.cuda.current_device()``; both sides run with it
returning ``"cpu"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.paths import ROOT

# Every test here runs megatron in worker processes (gloo worlds, a fresh interpreter).
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# Worker processes import this module: megatron is imported inside the worker functions only.

TARGET = "megatron.core.parallel_state"
TP_MODULES = ("layers", "random", "mappings", "cross_entropy")


def _tp_module(short: str):
    return importlib.import_module(f"megatron.core.tensor_parallel.{short}")


def _bound_names(ps_module) -> dict[str, list[str]]:
    """Per tensor-parallel module: the names bound to a function ``ps_module`` itself defines."""
    return {
        short: sorted(
            name
            for name, value in vars(_tp_module(short)).items()
            if inspect.isfunction(value)
            and getattr(ps_module, name, None) is value
            and value.__module__ == ps_module.__name__
        )
        for short in TP_MODULES
    }


def _bindings_point_to(ps_module) -> dict:
    """Where the module-level references megatron holds to parallel_state point."""
    import megatron.core
    import megatron.core.process_groups_config as pgc
    import megatron.core.utils

    return {
        "sys.modules": sys.modules[TARGET] is ps_module,
        "megatron.core.parallel_state": megatron.core.parallel_state is ps_module,
        "megatron.core.mpu": megatron.core.mpu is ps_module,
        "megatron.core.utils.parallel_state": megatron.core.utils.parallel_state is ps_module,
        "process_groups_config.parallel_state": pgc.parallel_state is ps_module,
    }


class _CpuDevice:
    """``torch.cuda.current_device()`` returns ``"cpu"`` inside the block."""

    def __enter__(self):
        self.saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"

    def __exit__(self, *exc):
        torch.cuda.current_device = self.saved


def _tensor_parallel_numbers() -> dict[str, list]:
    """Megatron's tensor-parallel ops on deterministic CPU tensors; outputs and input grads."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import mappings

    rank = dist.get_rank()
    tp = sys.modules[TARGET].get_tensor_model_parallel_world_size()
    out: dict[str, list] = {}

    def leaf(*shape, scale=1.0):
        n = 1
        for s in shape:
            n *= s
        values = (torch.arange(n, dtype=torch.float64) % 7 - 3 + 0.25 * rank) * scale
        return values.reshape(shape).requires_grad_(True)

    def record(name, fn, x, *args, **kwargs):
        y = fn(x, *args, **kwargs)
        out[f"{name}.out"] = y.detach().clone().tolist()
        grad = (torch.arange(y.numel(), dtype=y.dtype) % 5 + 1 + rank).reshape(y.shape)
        y.backward(grad)
        out[f"{name}.grad"] = x.grad.tolist()

    record("reduce_from_tp", mappings.reduce_from_tensor_model_parallel_region, leaf(4, 2, 8))
    record("copy_to_tp", mappings.copy_to_tensor_model_parallel_region, leaf(4, 2, 8))
    record("scatter_to_tp", mappings.scatter_to_tensor_model_parallel_region, leaf(4, 2, 8))
    record("gather_from_tp", mappings.gather_from_tensor_model_parallel_region, leaf(4, 2, 3))
    record("reduce_scatter_to_sp", mappings.reduce_scatter_to_sequence_parallel_region, leaf(4 * tp, 2, 3))
    record(
        "reduce_scatter_to_sp_buffer",
        mappings.reduce_scatter_to_sequence_parallel_region,
        leaf(4 * tp, 2, 3, scale=0.5),
        use_global_buffer=True,
    )
    record("gather_from_sp", mappings.gather_from_sequence_parallel_region, leaf(2, 2, 3))
    record(
        "gather_from_sp_buffer",
        mappings.gather_from_sequence_parallel_region,
        leaf(2, 2, 3, scale=2.0),
        use_global_buffer=True,
    )

    vocab_per_rank = 5
    logits = leaf(3, 2, vocab_per_rank, scale=0.3)
    target = torch.tensor([[0, 7], [3, 4 * tp - 1], [vocab_per_rank * tp - 1, 2]]) % (vocab_per_rank * tp)
    for smoothing in (0.0, 0.1):
        logits.grad = None
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
        out[f"cross_entropy{smoothing}.loss"] = loss.detach().tolist()
        loss.sum().backward()
        out[f"cross_entropy{smoothing}.grad"] = logits.grad.tolist()
    return out


def _collection_facts(cps) -> dict:
    """ProcessGroupCollection.use_mpu_process_groups() under install: compat's objects."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from compat.pg_collection import to_process_group_collection

    mpu = ProcessGroupCollection.use_mpu_process_groups()
    ours = to_process_group_collection()
    fields = [f.name for f in dataclasses.fields(ProcessGroupCollection)]
    t = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t, group=mpu.tp)
    return {
        "fields": len(fields),
        "same_as_export": all(getattr(mpu, f) is getattr(ours, f) for f in fields),
        "tp": mpu.tp is cps.get_tensor_model_parallel_group(),
        "dp": mpu.dp is cps.get_data_parallel_group(),
        "dp_cp": mpu.dp_cp is cps.get_data_parallel_group(with_context_parallel=True),
        "expt_dp": mpu.expt_dp is cps.get_expert_data_parallel_group(),
        "pp": mpu.pp is cps.get_pipeline_model_parallel_group(),
        "tp_sum": (int(t.item()), sum(dist.get_process_group_ranks(mpu.tp))),
    }


def _run_with_compat(tp_sizes, mcore_ps) -> dict:
    """Initialize through megatron.core.parallel_state (compat installed) and compute."""
    import megatron.core

    import compat.parallel_state as cps

    results = {}
    for tp in tp_sizes:
        megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            facts = {
                "state_is_compat": cps.get_state() is not None,
                "mcore_untouched": mcore_ps is None or not mcore_ps.is_initialized(),
                "tp_group_via_utils": megatron.core.utils.get_tensor_model_parallel_group_if_none(None)
                is cps.get_tensor_model_parallel_group(),
            }
            results[tp] = {
                "facts": facts,
                "collection": _collection_facts(cps),
                "numbers": _tensor_parallel_numbers(),
            }
        finally:
            megatron.core.parallel_state.destroy_model_parallel()
    return results


def _run_with_mcore(tp_sizes) -> dict:
    """Same computations with megatron-core's own parallel_state (groups it leaks are freed)."""
    mcore_ps = sys.modules[TARGET]
    results = {}
    for tp in tp_sizes:
        before = set(dist.distributed_c10d._world.pg_map)
        mcore_ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            results[tp] = _tensor_parallel_numbers()
        finally:
            mcore_ps.destroy_model_parallel()
            # MCore's destroy keeps its groups alive; this world is shared with other tests
            for group in set(dist.distributed_c10d._world.pg_map) - before:
                dist.destroy_process_group(group)
    return results


def _import_first_then_install(tp_sizes) -> dict:
    import megatron.core  # noqa: F401  (megatron first)
    import megatron.core.tensor_parallel  # noqa: F401

    import compat
    import compat.parallel_state as cps

    assert not compat.is_installed(), "a previous test left compat installed"
    mcore_ps = sys.modules[TARGET]
    names_before = _bound_names(mcore_ps)
    with warnings.catch_warnings(), _CpuDevice():
        warnings.simplefilter("ignore")
        compat.install()
        try:
            installed = {
                "bindings": _bindings_point_to(cps),
                "names": _bound_names(cps),
            }
            compat_results = _run_with_compat(tp_sizes, mcore_ps)
        finally:
            compat.uninstall()
        restored = {"bindings": _bindings_point_to(mcore_ps), "names": _bound_names(mcore_ps)}
        mcore_results = _run_with_mcore(tp_sizes)
    return {
        "names_before": names_before,
        "installed": installed,
        "compat": compat_results,
        "restored": restored,
        "mcore": mcore_results,
        "compat_left_installed": compat.is_installed(),
    }


def _install_then_import(tp_sizes) -> dict:
    already = sorted(m for m in sys.modules if m.split(".")[0] == "megatron")
    assert not already, f"this worker imported megatron before: {already[:5]}"
    import compat
    import compat.parallel_state as cps

    with warnings.catch_warnings(), _CpuDevice():
        warnings.simplefilter("ignore")
        compat.install()
        try:
            import megatron.core  # noqa: F401  (after install)
            import megatron.core.tensor_parallel  # noqa: F401

            installed = {"bindings": _bindings_point_to(cps), "names": _bound_names(cps)}
            compat_results = _run_with_compat(tp_sizes, None)
        finally:
            compat.uninstall()
        mcore_ps = sys.modules[TARGET]
        restored = {
            "is_megatron_module": mcore_ps is not cps and mcore_ps.__name__ == TARGET,
            "bindings": _bindings_point_to(mcore_ps),
            "names": _bound_names(mcore_ps),
        }
        mcore_results = _run_with_mcore(tp_sizes)
    return {
        "installed": installed,
        "compat": compat_results,
        "restored": restored,
        "mcore": mcore_results,
        "compat_left_installed": compat.is_installed(),
    }


def _check(results: list[dict], tp_sizes, expected_names: dict | None = None) -> dict:
    names = expected_names or results[0]["names_before"]
    assert all(names[short] for short in ("layers", "random", "cross_entropy")), names
    assert "get_global_memory_buffer" in names["mappings"]
    for rank, res in enumerate(results):
        assert all(res["installed"]["bindings"].values()), (rank, res["installed"]["bindings"])
        assert res["installed"]["names"] == names, (rank, "names not rebound to compat")
        assert all(res["restored"]["bindings"].values()), (rank, res["restored"]["bindings"])
        assert res["restored"]["names"] == names, (rank, "names not rebound to megatron")
        assert res["restored"].get("is_megatron_module", True)
        assert not res["compat_left_installed"]
        for tp in tp_sizes:
            ours = res["compat"][tp]
            assert all(ours["facts"].values()), (rank, tp, ours["facts"])
            coll = ours["collection"]
            assert coll["fields"] >= 20 and coll["same_as_export"], (rank, tp, coll)
            assert all(coll[k] for k in ("tp", "dp", "dp_cp", "expt_dp", "pp")), (rank, tp, coll)
            assert coll["tp_sum"][0] == coll["tp_sum"][1]
            theirs = res["mcore"][tp]
            assert set(ours["numbers"]) == set(theirs)
            for key, value in theirs.items():
                assert ours["numbers"][key] == value, f"rank {rank} tp {tp}: {key} differs from MCore"
    return names


@pytest.fixture(scope="module")
def fresh_world_2():
    """Two workers that have never imported megatron (the shared worlds may have)."""
    from parallel_state_ng.testing.worlds import GlooWorld

    world = GlooWorld(2)
    yield world
    world.close()


def test_megatron_imported_first_runs_on_compat(gloo_world):
    pytest.importorskip("megatron.core.tensor_parallel")
    tp_sizes = [2]
    results = gloo_world(4).run(_import_first_then_install, tp_sizes, timeout=400)
    names = _check(results, tp_sizes)
    # tp 2 on 4 ranks: the reduction really ran over compat's tp pairs, not the whole world
    x = results[0]["compat"][2]["numbers"]["reduce_from_tp.out"]
    y = results[2]["compat"][2]["numbers"]["reduce_from_tp.out"]
    assert x != y
    assert sum(len(v) for v in names.values()) >= 10


def test_compat_installed_before_megatron_import(fresh_world_2):
    pytest.importorskip("megatron.core.tensor_parallel")
    results = fresh_world_2.run(_install_then_import, [2], timeout=400)
    # the names MCore's modules bind, from this world's own restored state
    _check(results, [2], expected_names=results[0]["restored"]["names"])


_FIRST_IMPORT_IS_THE_MODULE = """
import sys
import compat
import compat.parallel_state as cps

compat.install()
import megatron.core.parallel_state as ps  # megatron's first import names the module itself
import megatron.core
from megatron.core.tensor_parallel import layers

facts = [ps is cps, megatron.core.parallel_state is cps, megatron.core.mpu is cps,
         sys.modules["megatron.core.parallel_state"] is cps, cps.__spec__.name == "compat.parallel_state",
         layers.get_tensor_model_parallel_rank.__module__ == "compat.parallel_state"]
compat.uninstall()
mcore = sys.modules["megatron.core.parallel_state"]
facts += [mcore is not cps, mcore.__name__ == "megatron.core.parallel_state",
          megatron.core.parallel_state is mcore,
          layers.get_tensor_model_parallel_rank.__module__ == "megatron.core.parallel_state"]
print(facts)
assert all(facts)
"""


@pytest.mark.rotating(5, 10)  # end-to-end part 6 of 10 (docs/testing.md, "Rotating parts")
def test_install_then_import_the_module_itself():
    """``compat.install()`` and then ``import megatron.core.parallel_state as ps`` (megatron not
    imported before): the parent packages load, the name is bound, and it is compat.
    """
    import os
    import subprocess

    pytest.importorskip("megatron.core.tensor_parallel")
    root = ROOT
    env = dict(
        os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT_IS_THE_MODULE], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
