"""parallel_state_ng: named-dimension process-group grids with Megatron-Core's exact layout.

* :class:`Layout` — pure rank/coordinate/group math (no torch.distributed).
* :class:`HyperCommGrid` — process groups over a layout; API-compatible with
  ``megatron.core.hyper_comm_grid.HyperCommGrid``, creating only the calling rank's groups.

The Megatron-shaped global API lives in the separate ``compat`` package.
"""

from .grid import BASE_VIEW, HyperCommGrid
from .layout import Layout, UnknownDimError

__all__ = ["HyperCommGrid", "Layout", "UnknownDimError", "BASE_VIEW"]
__version__ = "0.1.0"
