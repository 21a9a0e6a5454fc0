"""parallel_state_ng: named-dimension process-group grids with Megatron-Core's exact layout.

Public names: :class:`Layout` (pure rank math), :class:`HyperCommGrid`, :class:`GroupHandle`,
:func:`device_mesh`, :func:`build_megatron_groups`, :func:`build_topology`, :func:`no_globals`,
:func:`ensure_global_memory_buffer`, :func:`megatron_schedule`, :func:`abort_groups` and
:func:`verify_groups`. The Megatron-shaped global API lives in the separate ``compat`` package.
See docs/engine.md.
"""

from parallel_state_ng._version import __version__
from parallel_state_ng.builders.collection import MegatronGroups, build_megatron_groups
from parallel_state_ng.builders.grid import BASE_VIEW, HyperCommGrid
from parallel_state_ng.builders.megatron_setup import MegatronSchedule, ensure_global_memory_buffer, megatron_schedule
from parallel_state_ng.builders.scope import GlobalStateRefusedError, no_globals
from parallel_state_ng.builders.topology import Topology, build_topology
from parallel_state_ng.builders.verify import VerifyReport, verify_groups
from parallel_state_ng.groups.abort import AbortResult, abort_groups
from parallel_state_ng.groups.device_mesh import device_mesh
from parallel_state_ng.groups.handles import GroupHandle
from parallel_state_ng.layout.named_layout import Layout, UnknownDimError
from parallel_state_ng.layout.topology_spec import ModuleSpec, TopologySpecError

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
