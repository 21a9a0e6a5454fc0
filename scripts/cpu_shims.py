"""Stand-ins that let Megatron-Core's GPU training path run on CPU processes (gloo, no GPU).

Megatron-Core assumes CUDA in a few places that have nothing to do with parallel_state:
buffers allocated on ``torch.cuda.current_device()``, ``device="cuda"`` literals, the CUDA RNG
state behind the tensor-parallel RNG tracker, ``Tensor.cuda()``, CUDA tensor type names checked
by gradient clipping and the distributed optimizer, CUDA streams and events in the MoE
all-to-all dispatcher. :class:`CpuShims` redirects each of them to the CPU for the duration of a
``with`` block and restores everything on exit. None of this is needed (or wanted) on GPUs; it
is a test/example device shim, not part of ``compat``.

    shims = CpuShims()
    with shims:                      # torch-level stand-ins, megatron not imported yet
        import megatron.core ...
        shims.patch_megatron()       # megatron-level stand-ins (after megatron is imported)
        with shims.cuda_to_cpu():    # device="cuda" -> cpu for factory functions / .to()
            ...train...

The patches were worked out against megatron-core 0.16.1 with torch 2.13 (CPU build); every
megatron-level patch is skipped when the patched name does not exist in the loaded release.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CUDA_PREFIX = "torch.cuda."


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
    """Reversible CPU stand-ins for Megatron-Core's CUDA assumptions (see the module doc).

    ``__enter__`` patches torch; :meth:`patch_megatron` patches megatron modules (call it after
    megatron is imported, e.g. after ``compat.install()`` + import); ``__exit__`` undoes all of
    it, in reverse order. Not re-entrant.
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
