"""parallel_state_ng: named-dimension process-group grids with Megatron-Core's exact layout.

* :class:`Layout` — pure rank/coordinate/group math (no torch.distributed).
* :class:`HyperCommGrid` — process groups over a layout; API-compatible with
  ``megatron.core.hyper_comm_grid.HyperCommGrid``, creating only the calling rank's groups.
* :class:`GroupHandle` — one group seen from the caller: ring neighbours, first/last,
  collective helpers, a lazy gloo companion (``grid.group(dims)``).
* :func:`device_mesh` — a torch ``DeviceMesh`` over a grid's existing groups
  (``grid.device_mesh(dims)``).
* :func:`build_megatron_groups` — one module's Megatron groups (exactly those
  ``initialize_model_parallel`` builds, over a range of ranks) with no module global, exported
  as Megatron's ``ProcessGroupCollection`` (:class:`MegatronGroups`).
* :func:`build_topology` — a multi-module job (:class:`ModuleSpec` per module, disjoint or
  colocated ranks): every module's grid, groups and collection in one call (:class:`Topology`).
* :func:`no_globals` — a scope in which compat's global getters raise
  :class:`GlobalStateRefusedError` instead of answering for another grid
  (``MegatronGroups.scope()``); :func:`ensure_global_memory_buffer` and
  :func:`megatron_schedule` — the rest of the pg_collection path's set-up.
* :func:`abort_groups` — abort every group the engine created in this process, with no
  collective and no store wait (a rank's peers died or stopped).

The Megatron-shaped global API lives in the separate ``compat`` package.
"""

from parallel_state_ng._version import __version__
from parallel_state_ng.builders.collection import MegatronGroups, build_megatron_groups
from parallel_state_ng.builders.grid import BASE_VIEW, HyperCommGrid
from parallel_state_ng.builders.megatron_setup import MegatronSchedule, ensure_global_memory_buffer, megatron_schedule
from parallel_state_ng.builders.scope import GlobalStateRefusedError, no_globals
from parallel_state_ng.builders.topology import Topology, build_topology
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
]
