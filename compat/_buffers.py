"""The global memory buffer MCore keeps beside the parallel state."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch


class GlobalMemoryBuffer:
    """Reusable named scratch tensors, one flat allocation per (name, dtype).

    ``get_tensor(shape, dtype, name)`` returns a view of the buffer for ``(name, dtype)``,
    growing it when too small. Callers must not use the same name concurrently. Allocations
    go to ``torch.cuda.current_device()``, as in MCore.
    """

    def __init__(self) -> None:
        self.buffer: dict = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Callable | None = None):
        """A tensor of ``tensor_shape`` and ``dtype`` backed by the buffer named ``name``."""
        needed = math.prod(tensor_shape)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < needed:
            with (mem_alloc_context or nullcontext)():
                self.buffer[(name, dtype)] = torch.empty(
                    needed, dtype=dtype, device=torch.cuda.current_device(), requires_grad=False
                )
        return self.buffer[(name, dtype)][0:needed].view(*tensor_shape)
