"""What the torch at hand can do, for tests whose outcome depends on its build or machine.

A CPU build of torch has no NCCL; a CUDA build has it with or without a GPU, but creates NCCL
groups and runs ``torch.cuda`` calls (MCore's SHARP barrier) only with one. Tests ask here
instead of assuming a CPU build.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["nccl_built", "cuda_device", "nccl_usable", "fake_group_takes_nccl_options", "describe"]


def nccl_built() -> bool:
    """Whether this torch build has NCCL (``torch.distributed.is_nccl_available()``)."""
    return dist.is_available() and dist.is_nccl_available()


def cuda_device() -> bool:
    """Whether this process sees a CUDA device (``torch.cuda.is_available()``)."""
    return torch.cuda.is_available()


def nccl_usable() -> bool:
    """Whether NCCL groups can be created and CUDA calls made here: NCCL built in and a GPU."""
    return nccl_built() and cuda_device()


def fake_group_takes_nccl_options() -> bool:
    """Whether a simulated world's group (fake backend) can be made with ``ProcessGroupNCCL.Options``.

    MCore hands NCCL options to ``new_group`` for an NCCL communicator config or a high-priority
    stream group. On the fake backend that works only with a torch built with NCCL (a CPU build
    has no ``ProcessGroupNCCL``: AttributeError) whose fake backend ignores ``pg_options``; from
    ``TORCH_FACTS["fake_backend_takes_options"]`` on, it hands them to ``FakeProcessGroup``, which
    takes only its own options (TypeError).
    """
    from parallel_state_ng.groups.torch_support import torch_has

    return nccl_built() and not torch_has("fake_backend_takes_options")


def describe() -> str:
    """One line for skip and failure messages: the torch version, NCCL, GPU."""
    return (
        f"torch {torch.__version__} ({'with' if nccl_built() else 'without'} NCCL, "
        f"{'a' if cuda_device() else 'no'} CUDA device)"
    )
