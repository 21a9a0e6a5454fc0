"""Destroy frees every group at once: no reference cycle keeps a process group alive.

A group held by a reference cycle outlives its destroy until the garbage collector happens
to run, which can be in the middle of a later init or training step. Freeing a gloo group
there blocked the rank for 1-2 s (measured on an 8-process gloo world, where the recursive
closure in ``global_values`` held compat's whole value dict). Here every API that creates
groups runs one create/destroy cycle with the collector off; afterwards the collector must
find nothing of ours: no function of these packages and no container holding a group.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng import HyperCommGrid, ModuleSpec, build_megatron_groups, build_topology
from tests.support.served import has_collection, skip_unless

_OURS = ("parallel_state_ng", "compat")
_NO_GLOO = {"create_gloo_process_groups": False}  # the fake backend makes no gloo groups


def _compat_cycle() -> None:
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        create_gloo_process_groups=False,  # the fake backend makes no gloo groups
    )
    ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()


def _grid_cycle() -> None:
    grid = HyperCommGrid([2, 4, 2], ["tp", "dp", "pp"])
    grid.create_pg("tp")
    grid.create_pg(["tp", "dp"])
    grid.destroy()


def _collection_cycle() -> None:
    groups = build_megatron_groups(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
    )
    groups.field_values()
    groups.destroy()


def _topology_cycle() -> None:
    topology = build_topology(
        [
            ModuleSpec("vision", range(0, 16), options=_NO_GLOO),
            ModuleSpec("language", range(0, 16), tensor_model_parallel_size=2, language=True, options=_NO_GLOO),
        ]
    )
    topology.collection("language")
    topology.destroy()


CYCLES: dict[str, Callable[[], None]] = {
    "compat": _compat_cycle,
    "grid": _grid_cycle,
    "build_megatron_groups": _collection_cycle,
    "build_topology": _topology_cycle,
}


def _holds_group(obj: object) -> bool:
    if isinstance(obj, dict):
        items: Iterator[object] = iter([*obj.keys(), *obj.values()])
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = iter(obj)
    else:
        return False
    return any(isinstance(item, dist.ProcessGroup) for item in items)


def _ours(obj: object) -> bool:
    module = getattr(obj, "__module__", None) if callable(obj) else type(obj).__module__
    return isinstance(module, str) and module.startswith(_OURS)


@pytest.mark.parametrize("api", sorted(CYCLES))
def test_destroy_leaves_no_cyclic_garbage(fake_world, api):
    if api == "build_topology":  # a topology's modules hand out their collections
        skip_unless(has_collection(), "has no ProcessGroupCollection (it came in 0.15)")
    fake_world(5, 16)
    CYCLES[api]()  # first use: imports and caches, whose objects may live in cycles for good
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        CYCLES[api]()
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    holding = [type(obj).__name__ for obj in garbage if _holds_group(obj)]
    ours = sorted({getattr(obj, "__qualname__", type(obj).__qualname__) for obj in garbage if _ours(obj)})
    assert holding == [], f"{api}: cyclic garbage holds process groups in {holding}"
    assert ours == [], f"{api}: cyclic garbage of ours: {ours}"
