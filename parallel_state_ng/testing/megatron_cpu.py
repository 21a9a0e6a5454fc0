"""Running Megatron on CPU processes (gloo, no GPU): reversible stand-ins for its CUDA assumptions.

:class:`CpuShims` redirects Megatron-Core's CUDA assumptions (devices, RNG, streams, tensor type
names) to the CPU for the duration of a ``with`` block and restores everything on exit;
Megatron-LM's training loop needs more: :class:`TrainingShims`. :func:`use_megatron_path` puts
another megatron-core first on ``sys.path``. None of this is needed (or wanted) on GPUs; it is a
test/example device shim, not part of ``compat``. See docs/results/training.md and scripts/README.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CUDA_PREFIX = "torch.cuda."
#: The environment variable naming the directory :func:`use_megatron_path` uses when given none.
MEGATRON_PATH_ENV = "PSNG_MEGATRON_PATH"


def use_megatron_path(path: str | None = None, *, env: str | None = MEGATRON_PATH_ENV) -> list[str]:
    """Put ``path`` (default: the environment variable ``env``) first on ``sys.path``; the
    directories put there (none: ``path`` and the variable are unset or empty).

    ``path`` is a directory holding ``megatron/`` (e.g. an unzipped megatron-core wheel of
    another release), or several directories separated by ``os.pathsep`` (a wheel and the
    wheels it needs beside it), which come first in that order. Call it before megatron is first
    imported: raises ``RuntimeError`` when ``megatron.core`` is already loaded from elsewhere.
    Spawned worker processes inherit the changed ``sys.path``.
    """
    path = path or (os.environ.get(env) if env else None)
    dirs = [d for d in (path or "").split(os.pathsep) if d]
    loaded = sys.modules.get("megatron.core")
    where = getattr(loaded, "__file__", None)
    if dirs and where and not any(os.path.abspath(where).startswith(os.path.abspath(d)) for d in dirs):
        raise RuntimeError(f"megatron is already imported from {where}, not from {path}")
    if dirs:
        sys.path[:] = dirs + [p for p in sys.path if p not in dirs]
    return dirs


def _is_cuda(device: Any) -> bool:
    """Whether ``device`` (str, torch.device or int index) names a CUDA device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in ``device=`` arguments and in ``Tensor.to(...)``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.dtype):
            if _is_cuda(args[1]) and not isinstance(args[1], torch.Tensor):
                args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Event:
    """A CUDA event stand-in: CPU work is already complete when it is recorded."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record on the CPU."""

    def synchronize(self) -> None:
        """Nothing to wait for on the CPU."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for on the CPU."""

    def query(self) -> bool:
        """Always complete."""
        return True


class _Stream:
    """A CUDA stream stand-in: CPU ops run in program order, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        """Nothing to order on the CPU."""

    def wait_event(self, event: Any) -> None:
        """Nothing to order on the CPU."""

    def record_event(self, event: Any = None) -> _Event:
        """Return a completed event."""
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        """Nothing to wait for on the CPU."""


_CURRENT_STREAM = _Stream()


def _cpu_type(original: Callable) -> Callable:
    """``Tensor.type()`` reporting CUDA type names (``torch.cuda.FloatTensor``) for CPU tensors.

    Megatron's gradient clipping asserts it and the distributed optimizer dispatches on it;
    conversions (``t.type(torch.float16)``) go to the original method unchanged.
    """

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if name.startswith("torch.") and not name.startswith(_CUDA_PREFIX):
                name = _CUDA_PREFIX + name[len("torch.") :]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    return type_


def _split_sizes_as_ints(all_to_all: Callable) -> Callable:
    """Wrap megatron's ``all_to_all(group, input, output_split_sizes, input_split_sizes)`` so
    split sizes held in tensors / arrays (GPU runs move them to host numpy arrays) become lists
    of Python ints, which ``torch.distributed.all_to_all_single`` requires.
    """

    def as_ints(sizes: Any) -> Any:
        if sizes is None or isinstance(sizes, list):
            return sizes
        return [int(s) for s in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]

    def wrapped(group, input_, output_split_sizes_=None, input_split_sizes=None, **options):
        # options: later releases' keywords (0.19: use_nccl_stream), passed on unchanged
        return all_to_all(group, input_, as_ints(output_split_sizes_), as_ints(input_split_sizes), **options)

    wrapped.__wrapped__ = all_to_all  # type: ignore[attr-defined]
    return wrapped


class CpuShims:
    """Reversible CPU stand-ins for Megatron-Core's CUDA assumptions.

    Megatron-Core assumes CUDA in a few places that have nothing to do with parallel_state:
    buffers allocated on ``torch.cuda.current_device()``, ``device="cuda"`` literals, the CUDA RNG
    state behind the tensor-parallel RNG tracker, ``Tensor.cuda()``, CUDA tensor type names checked
    by gradient clipping and the distributed optimizer, CUDA streams and events in the MoE
    all-to-all dispatcher.

    ``__enter__`` patches torch; :meth:`patch_megatron` patches megatron modules (call it after
    megatron is imported, e.g. after ``compat.install()`` + import); ``__exit__`` undoes all of
    it, in reverse order. Not re-entrant. The patches were worked out against megatron-core 0.16.1
    with torch 2.13 (CPU build); every megatron-level patch is skipped when the patched name does
    not exist in the loaded release. Megatron is imported only by the methods that patch it::

        shims = CpuShims()
        with shims:                      # torch-level stand-ins, megatron not imported yet
            import megatron.core ...
            shims.patch_megatron()       # megatron-level stand-ins (after megatron is imported)
            with shims.cuda_to_cpu():    # device="cuda" -> cpu for factory functions / .to()
                ...train...
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def _set(self, owner: Any, name: str, value: Any) -> None:
        existed = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
        self._saved.append((owner, name, getattr(owner, name, None), existed))
        setattr(owner, name, value)

    def __enter__(self) -> CpuShims:
        cuda = torch.cuda
        self._set(cuda, "current_device", lambda: "cpu")
        self._set(cuda, "synchronize", lambda *args, **kwargs: None)
        # the CPU generator itself: torch.manual_seed calls torch.cuda.manual_seed_all
        self._set(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
        self._set(cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state())
        self._set(cuda, "set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
        self._set(cuda.random, "get_rng_state", cuda.get_rng_state)
        self._set(cuda.random, "set_rng_state", cuda.set_rng_state)
        self._set(cuda, "Stream", _Stream)
        self._set(cuda, "Event", _Event)
        self._set(cuda, "current_stream", lambda *args, **kwargs: _CURRENT_STREAM)
        self._set(cuda, "stream", lambda stream=None: contextlib.nullcontext())
        self._set(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
        self._set(torch.Tensor, "type", _cpu_type(torch.Tensor.type))
        return self

    def patch_megatron(self) -> None:
        """Patch the megatron modules that are loaded (imports the ones it patches)."""
        random = importlib.import_module("megatron.core.tensor_parallel.random")
        if hasattr(random, "_get_cuda_rng_state"):
            self._set(random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
        if hasattr(random, "_set_cuda_rng_state"):
            self._set(random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
        # The tracker warns when the CPU generator changes inside a CUDA RNG fork; here the
        # CUDA generator IS the CPU one, so every fork (dropout under tp) would warn.
        self._set(logging.getLogger(random.__name__), "disabled", True)
        try:
            moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
            dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
        except ImportError:
            return
        if not hasattr(moe_utils, "te_general_gemm"):
            # referenced unconditionally by the router but only defined when TE imports
            self._set(moe_utils, "te_general_gemm", None)
        if hasattr(dispatcher, "all_to_all") and not hasattr(dispatcher.all_to_all, "__wrapped__"):
            self._set(dispatcher, "all_to_all", _split_sizes_as_ints(dispatcher.all_to_all))

    @contextlib.contextmanager
    def cuda_to_cpu(self) -> Iterator[None]:
        """Inside the block, ``device="cuda"`` (factory functions, ``Tensor.to``) means the CPU."""
        with _CudaToCpuMode():
            yield

    def __exit__(self, *exc: Any) -> None:
        while self._saved:
            owner, name, value, existed = self._saved.pop()
            if existed:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


_CAPABILITY = (9, 0)
_PROPERTIES = types.SimpleNamespace(
    name="CPU (stand-in)", major=_CAPABILITY[0], minor=_CAPABILITY[1], total_memory=0, multi_processor_count=1
)


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class TrainingShims:
    """Reversible stand-ins for ``megatron.training``'s CUDA assumptions (see :class:`CpuShims`).

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
        # CUDA-to-CPU TorchFunctionMode of CpuShims ("list indices must be integers")
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
