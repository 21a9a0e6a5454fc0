"""What differs between torch releases for this package, stated once, and the internals it reads.

:data:`TORCH_FACTS` is the one table of behaviours that change with the torch at hand (first
release with the behaviour, last or ``None`` for "still"); :func:`torch_has` reads it for the
installed torch. :func:`report` lists the torch internals the package reads (``_world.pg_map``,
``bound_device_id``, ``_get_split_source``, the fake backend and ``FakeStore``, DeviceMesh's
``_flatten_mapping``, ``split_group`` and its signature, the group-creation helper the simulated
worlds wrap) as present or missing: ``python -m scripts.matrix torch_matrix`` prints it per
version (docs/results/torch.md).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

__all__ = ["TORCH_FACTS", "torch_release", "torch_has", "empty_group_error", "report"]

#: fact -> (first torch release with it, last release with it or ``None``: still).
TORCH_FACTS: dict[str, tuple[str, str | None]] = {
    # torch.distributed.split_group(parent_pg, split_ranks, timeout, pg_options, group_desc):
    # the split path (parallel_state_ng.groups.split) needs it; absent on 2.4.1, present with
    # that signature on 2.5.1 (read in its distributed_c10d.py) and every release after.
    "split_group": ("2.5", None),
    # new_group([]) on a world of any size: _new_process_group_helper raises
    # AssertionError("Group rank must be specified for group members"). Before, the empty list
    # reached ProcessGroup's constructor with rank None: TypeError (read in 2.13.0 and 2.14.1's
    # distributed_c10d.py). MCore hands an empty embedding-rank list to new_group.
    "empty_new_group_asserts": ("2.14", None),
    # torch.distributed.distributed_c10d._abort_process_group(group): absent on 2.4.1; the engine's
    # abort (parallel_state_ng.groups.abort) then unregisters the group itself.
    "abort_process_group": ("2.6", None),
    # _abort_process_group(group) aborts and unregisters a group of any backend; on 2.6 it is a
    # no-op (a warning) for a group without an NCCL backend, which stays registered: the engine
    # then unregisters it itself (read in 2.6.0 and 2.7.1's distributed_c10d.py).
    "abort_process_group_any_backend": ("2.7", None),
    # torch.distributed.shrink_group(ranks_to_exclude, group, shrink_flags, pg_options): recovery
    # in place (parallel_state_ng.groups.recovery) needs it; without it the survivors
    # re-initialize. Absent on 2.9.1, present on 2.10.0 (read in the wheels' distributed_c10d.py).
    "shrink_group": ("2.10", None),
    # The fake backend (simulated worlds) is registered with extended_api and hands a group's
    # pg_options to FakeProcessGroup, which takes only its own options: ProcessGroupNCCL.Options
    # (MCore's NCCL communicator config, high-priority streams) raise TypeError there. Before, it
    # ignored pg_options (read in 2.8.0 and 2.9.1's fake_pg.py).
    "fake_backend_takes_options": ("2.9", None),
    # DeviceMesh keeps its flattened dims (mesh[...]._flatten(name)) in its own _flatten_mapping;
    # before, in _mesh_resources.root_to_flatten_mapping under the root mesh (read in 2.6.0 to
    # 2.9.1; 2.4.1 has no _flatten). verify_groups reads either (builders/verify/sources.py).
    "device_mesh_flatten_mapping": ("2.10", None),
    # dist.get_backend of a group no longer registered raises ValueError; before, TypeError
    # ("Invariant encountered"), which torch's exception logger raises in place of the error of a
    # collective on such a group (a destroyed one: the engine's RuntimeError). Read in 2.7.1 and
    # 2.8.0's distributed_c10d.py.
    "unregistered_group_backend_valueerror": ("2.8", None),
    # Freeing the last Python reference to a ProcessGroup releases the GIL while its backends are
    # destroyed (pytorch/pytorch#154976). Before, ~ProcessGroupGloo ran under the GIL and took
    # its work mutex, while a gloo worker thread holding that mutex waited for the GIL to free a
    # finished collective's tensor: a deadlock right after a collective, measured on 2.5.1 and
    # 2.6.0 (docs/results/torch.md); the engine then keeps destroyed groups' backends (creation.py).
    "pg_destructor_releases_gil": ("2.8", None),
}


def torch_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch's ``__version__``)."""
    found = re.match(r"(\d+)\.(\d+)", version if version is not None else torch.__version__)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def torch_has(fact: str, version: str | None = None) -> bool:
    """Whether the torch release ``version`` (default: installed) has ``fact`` of :data:`TORCH_FACTS`.

    Raises:
        KeyError: ``fact`` is not in :data:`TORCH_FACTS` (the message lists them).
    """
    if fact not in TORCH_FACTS:
        raise KeyError(f"unknown torch fact {fact!r}; known: {sorted(TORCH_FACTS)}")
    first, last = TORCH_FACTS[fact]
    release = torch_release(version)
    return torch_release(first) <= release and (last is None or release <= torch_release(last))


def empty_group_error(version: str | None = None) -> type[Exception]:
    """The exception type MCore's ``new_group([])`` raises on torch ``version`` (default: installed)."""
    return AssertionError if torch_has("empty_new_group_asserts", version) else TypeError


def _signature(obj: Any) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def report() -> dict[str, Any]:
    """The installed torch's version, its facts, and each internal the package reads: present or not."""
    import torch.distributed as dist

    c10d: Any = dist.distributed_c10d
    internals: dict[str, Any] = {
        "_world.pg_map": hasattr(getattr(c10d, "_world", None), "pg_map"),
        "ProcessGroup.bound_device_id": hasattr(dist.ProcessGroup, "bound_device_id"),
        "_get_split_source": hasattr(c10d, "_get_split_source"),
        "_new_process_group_helper(backend)": "backend"
        in (_signature(getattr(c10d, "_new_process_group_helper", None)) or ""),
        "_process_group_name": hasattr(c10d, "_process_group_name"),
        "split_group": _signature(getattr(dist, "split_group", None)),
        "_abort_process_group": hasattr(c10d, "_abort_process_group"),
        "shrink_group": hasattr(dist, "shrink_group"),
        # the hang watch (groups/hang_watch.py): group names, and torch's flight-recorder dump
        "_get_process_group_name": hasattr(c10d, "_get_process_group_name"),
        "_dump_fr_trace": hasattr(torch._C._distributed_c10d, "_dump_fr_trace"),
    }
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

        internals["fake backend + FakeStore"] = "fake" in str(getattr(dist.Backend, "FAKE", ""))
    except ImportError:
        internals["fake backend + FakeStore"] = False
    try:
        from torch.distributed.device_mesh import DeviceMesh

        internals["DeviceMesh._flatten_mapping"] = "self._flatten_mapping" in inspect.getsource(DeviceMesh)
    except (ImportError, OSError, TypeError):
        internals["DeviceMesh._flatten_mapping"] = False
    return {
        "torch": torch.__version__,
        "facts": {name: torch_has(name) for name in TORCH_FACTS},
        "internals": internals,
    }
