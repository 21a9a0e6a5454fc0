"""What the installed torch allows a sleep to do, pinned (parallel_state_ng/groups/sleep.py).

If a torch release starts to allow one of these (a Python backend, replacing a registered
backend, gloo suspend), these tests fail and the module's ``fenced`` path can become a real
release and rebuild.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

c10d: Any = torch._C._distributed_c10d  # torch's stub lacks FakeProcessGroup's options argument
CPU = torch.device("cpu")
GLOO = dist.ProcessGroup.BackendType.GLOO


def _gloo(store, prefix: str):
    return c10d.ProcessGroupGloo(dist.PrefixStore(prefix, store), 0, 1, timedelta(seconds=10))


def test_registering_a_type_again_keeps_the_first_backend():
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    first = _gloo(store, "a/")
    group._register_backend(CPU, GLOO, first)
    group._set_default_backend(GLOO)
    held = group._backend_id(GLOO)
    group._register_backend(CPU, GLOO, _gloo(store, "b/"))
    assert group._backend_id(GLOO) == held  # no way to drop or replace it


def test_python_subclasses_of_backend_cannot_be_made():
    class Guard(c10d.Backend):
        pass

    with pytest.raises(TypeError, match="No constructor defined"):
        Guard(0, 1)


def test_gloo_has_no_suspend_nor_memory_stats():
    backend = _gloo(dist.HashStore(), "c/")
    with pytest.raises(RuntimeError, match="does not support suspend"):
        backend.suspend()
    with pytest.raises(RuntimeError, match="does not support getMemoryStats"):
        backend.memory_stats()


def test_a_second_type_routes_the_device_and_back():
    """The guard's route: another backend type takes the device, the first type takes it back."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    first = _gloo(store, "d/")
    group._register_backend(CPU, GLOO, first)
    group._set_default_backend(GLOO)
    options = c10d.FakeProcessGroup.Options()
    options.error_on_collective = True
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(CPU, custom, c10d.FakeProcessGroup._create_internal(0, 1, options))
    with pytest.raises(RuntimeError, match="error_on_collective"):
        group.allreduce([torch.ones(1)]).wait()
    group.send([torch.ones(1)], 0, 0).wait()  # the guard's point-to-point calls do not raise (a gap)
    group._register_backend(CPU, GLOO, first)
    t = torch.ones(1)
    group.allreduce([t]).wait()
    assert t.item() == 1.0
