"""CPU stand-ins that Megatron-LM's training loop (``megatron.training``) needs beyond
:mod:`cpu_shims` (which covers megatron.core). Test/example code, never part of ``compat``.

``megatron.training`` treats the GPU as given: ``initialize_megatron`` only sets up model
parallelism when ``torch.cuda.device_count() > 0`` and calls ``torch.cuda.set_device``; the
logging reads CUDA memory statistics; ``setup_model_and_optimizer`` moves the model with
``.cuda(device)``. :class:`TrainingShims` answers each of these for a CPU process, for the
duration of a ``with`` block, and restores everything on exit.
"""

from __future__ import annotations

import importlib
import types
import typing
from typing import Any

import torch

_CAPABILITY = (9, 0)
_PROPERTIES = types.SimpleNamespace(
    name="CPU (stand-in)", major=_CAPABILITY[0], minor=_CAPABILITY[1], total_memory=0, multi_processor_count=1
)


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class TrainingShims:
    """Reversible stand-ins for ``megatron.training``'s CUDA assumptions (see the module doc).

    ``__enter__`` patches ``torch.cuda``; :meth:`patch_megatron` patches ``megatron.training``
    modules (after megatron is importable); ``__exit__`` undoes both, in reverse order.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def _set(self, owner: Any, name: str, value: Any) -> None:
        existed = hasattr(owner, name)
        self._saved.append((owner, name, getattr(owner, name, None), existed))
        setattr(owner, name, value)

    def __enter__(self) -> TrainingShims:
        if not hasattr(typing, "override"):
            # Python 3.11: 0.19's megatron/training/models/hybrid.py imports typing.override (3.12)
            import typing_extensions

            self._set(typing, "override", typing_extensions.override)
        cuda = torch.cuda
        # one "device" per process: initialize_megatron builds the model-parallel groups only
        # when it sees a device
        self._set(cuda, "is_available", lambda: True)  # initialize_megatron asserts it
        self._set(cuda, "device_count", lambda: 1)
        self._set(cuda, "set_device", _nothing)
        # the argument checks ask for the device architecture (tp > 1: whether
        # CUDA_DEVICE_MAX_CONNECTIONS=1 is required, i.e. before Blackwell): answer a Hopper
        self._set(cuda, "get_device_capability", lambda *args, **kwargs: _CAPABILITY)
        self._set(cuda, "get_device_properties", lambda *args, **kwargs: _PROPERTIES)
        # memory statistics for the log lines: no device memory on a CPU run
        for name in (
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
        ):
            self._set(cuda, name, _zero)
        self._set(cuda, "memory_stats", lambda *args, **kwargs: {})
        self._set(cuda, "reset_peak_memory_stats", _nothing)
        self._set(cuda, "empty_cache", _nothing)
        # functions Megatron wraps in torch.compile (jit_fuser: the MoE router's expert-bias
        # update, from 0.17 on) run eagerly: TorchDynamo fails tracing them under the
        # CUDA-to-CPU TorchFunctionMode of cpu_shims ("list indices must be integers")
        self._set(importlib.import_module("torch._dynamo").config, "disable", True)
        return self

    def patch_megatron(self) -> None:
        """Patch loaded ``megatron.training`` modules (imports the ones it patches)."""
        importlib.import_module("megatron.training")
        # initialize_megatron builds the datasets' C++ index helpers with `make` on rank 0; the
        # wheels ship no Makefile (and a cp312 binary) and the in-memory dataset of the example
        # never calls them
        utils = importlib.import_module("megatron.core.datasets.utils")
        self._set(utils, "compile_helpers", _nothing)
        # pretrain warms up the fused bias-GeLU / bias-SwiGLU kernels (torch.compile for CUDA)
        # on GPU tensors; the CPU run has every fusion switched off and never calls them
        initialize = importlib.import_module("megatron.training.initialize")
        if hasattr(initialize, "_warmup_jit_function"):
            self._set(initialize, "_warmup_jit_function", _nothing)

    def __exit__(self, *exc: Any) -> None:
        while self._saved:
            owner, name, value, existed = self._saved.pop()
            if existed:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
