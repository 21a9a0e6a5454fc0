"""Sending picklable Python objects over a process group without numpy.

``torch.distributed``'s object collectives (``broadcast_object_list``, ``gather_object``, ...)
turn the received bytes back into objects through ``Tensor.numpy()``, so they fail with
"Numpy is not available" where numpy is not installed — and this project's only runtime
dependency is torch. These helpers pickle into a ``uint8`` tensor and read the bytes back
straight from the tensor's memory instead (one copy; iterating a storage costs ~3 us a byte).
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["object_to_tensor", "tensor_to_object", "all_gather_objects", "broadcast_object"]


def object_to_tensor(obj: Any) -> torch.Tensor:
    """``obj`` pickled into a 1-D ``uint8`` CPU tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def tensor_to_object(tensor: torch.Tensor, size: int | None = None) -> Any:
    """The object pickled in the first ``size`` bytes (default: all) of a ``uint8`` tensor."""
    data = tensor.detach().to("cpu").contiguous()
    if size is not None:
        data = data[:size]
    return pickle.loads(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every member's ``obj``, in the group's rank order (a collective over ``group``)."""
    payload = object_to_tensor(obj)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(chunks, padded, group=group)
    return [tensor_to_object(chunk, int(size.item())) for chunk, size in zip(chunks, sizes, strict=True)]


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """``obj`` of global rank ``src`` on every member of ``group`` (a collective)."""
    if dist.get_rank() == src:
        payload = object_to_tensor(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        payload, size = None, torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return tensor_to_object(payload)
