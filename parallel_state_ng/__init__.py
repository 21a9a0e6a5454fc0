"""parallel_state_ng: named-dimension process-group grids with Megatron-Core's exact layout.

Public names: :class:`Layout` (pure rank math), :class:`HyperCommGrid`, :class:`GroupHandle`,
:func:`device_mesh`, :func:`build_megatron_groups`, :func:`build_topology`, :func:`no_globals`,
:func:`ensure_global_memory_buffer`, :func:`megatron_schedule`, :func:`abort_groups` and
:func:`verify_groups`. The Megatron-shaped global API lives in the separate ``compat`` package.
See docs/engine.md.

The names are imported on first use, so that ``import parallel_state_ng`` (and its command line,
whose ``layout``, ``topology`` and ``port`` commands are pure layout math) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from parallel_state_ng._version import __version__

if TYPE_CHECKING:
    from parallel_state_ng.builders.collection import MegatronGroups, build_megatron_groups
    from parallel_state_ng.builders.grid import BASE_VIEW, HyperCommGrid
    from parallel_state_ng.builders.megatron_setup import (
        MegatronSchedule,
        ensure_global_memory_buffer,
        megatron_schedule,
    )
    from parallel_state_ng.builders.scope import GlobalStateRefusedError, no_globals
    from parallel_state_ng.builders.topology import Topology, build_topology
    from parallel_state_ng.builders.verify import VerifyReport, verify_groups
    from parallel_state_ng.groups.abort import AbortResult, abort_groups
    from parallel_state_ng.groups.device_mesh import device_mesh
    from parallel_state_ng.groups.handles import GroupHandle
    from parallel_state_ng.layout.named_layout import Layout, UnknownDimError
    from parallel_state_ng.layout.topology_spec import ModuleSpec, TopologySpecError

#: Where each public name is defined: imported from there on first use.
_WHERE = {
    "MegatronGroups": "parallel_state_ng.builders.collection",
    "build_megatron_groups": "parallel_state_ng.builders.collection",
    "BASE_VIEW": "parallel_state_ng.builders.grid",
    "HyperCommGrid": "parallel_state_ng.builders.grid",
    "MegatronSchedule": "parallel_state_ng.builders.megatron_setup",
    "ensure_global_memory_buffer": "parallel_state_ng.builders.megatron_setup",
    "megatron_schedule": "parallel_state_ng.builders.megatron_setup",
    "GlobalStateRefusedError": "parallel_state_ng.builders.scope",
    "no_globals": "parallel_state_ng.builders.scope",
    "Topology": "parallel_state_ng.builders.topology",
    "build_topology": "parallel_state_ng.builders.topology",
    "VerifyReport": "parallel_state_ng.builders.verify",
    "verify_groups": "parallel_state_ng.builders.verify",
    "AbortResult": "parallel_state_ng.groups.abort",
    "abort_groups": "parallel_state_ng.groups.abort",
    "device_mesh": "parallel_state_ng.groups.device_mesh",
    "GroupHandle": "parallel_state_ng.groups.handles",
    "Layout": "parallel_state_ng.layout.named_layout",
    "UnknownDimError": "parallel_state_ng.layout.named_layout",
    "ModuleSpec": "parallel_state_ng.layout.topology_spec",
    "TopologySpecError": "parallel_state_ng.layout.topology_spec",
}

__all__ = [
    "__version__",
    "HyperCommGrid",
    "Layout",
    "UnknownDimError",
    "BASE_VIEW",
    "GroupHandle",
    "device_mesh",
    "MegatronGroups",
    "build_megatron_groups",
    "ModuleSpec",
    "Topology",
    "TopologySpecError",
    "build_topology",
    "no_globals",
    "GlobalStateRefusedError",
    "ensure_global_memory_buffer",
    "megatron_schedule",
    "MegatronSchedule",
    "abort_groups",
    "AbortResult",
    "verify_groups",
    "VerifyReport",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'parallel_state_ng' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
