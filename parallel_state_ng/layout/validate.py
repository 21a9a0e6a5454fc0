"""Up-front checks of ``initialize_model_parallel`` arguments (compat and the engine's builders).

Each check names the argument and its value, with MCore's exception type where MCore rejects
the value (the error classes below say which), a plain ``ValueError`` or ``TypeError`` where MCore
would build a wrong layout. Layout-level conditions are
:class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`'s. See docs/differences.md.
"""

from __future__ import annotations

import errno
import numbers
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

from parallel_state_ng.layout.init_args import InitArgs

__all__ = [
    "validate_initialize_args",
    "ZeroSizeError",
    "SizeBelowOneError",
    "ZeroHierarchicalSizeError",
    "NegativeWorldSizeError",
    "OrderTypeError",
    "BackendTypeError",
]


class ZeroSizeError(ValueError, ZeroDivisionError):
    """A parallel size of 0 (MCore fails on it with ``ZeroDivisionError``)."""


class SizeBelowOneError(ValueError, AssertionError):
    """A negative parallel size, or a hierarchical context-parallel size below 1 (MCore fails
    on them with ``AssertionError``).
    """


class ZeroHierarchicalSizeError(SizeBelowOneError, ZeroDivisionError):
    """A hierarchical context-parallel size of 0 (0.13+ fail on it with ``AssertionError``,
    0.12 divides by it: ``ZeroDivisionError``).
    """


class OrderTypeError(TypeError, AttributeError):
    """``order`` is not a str (MCore fails on it with ``AttributeError``)."""


class NegativeWorldSizeError(ValueError, TypeError):
    """A negative ``local_world_size`` (MCore 0.17+ fails on it in torch with ``TypeError``)."""


class BackendTypeError(TypeError, ValueError):
    """``pipeline_model_parallel_comm_backend`` is not a str (MCore: ``ValueError``)."""


_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "num_distributed_optimizer_instances",
    "gtp_remat_size",
    "expert_gtp_remat_size",
)
_OPTIONAL_SIZES = ("expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size")
_FLAGS = ("use_sharp", "hybrid_context_parallel", "create_gloo_process_groups")
_CALLABLES = ("get_embedding_ranks", "get_position_embedding_ranks")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_size(name: str, value: Any, zero_error: type = ZeroSizeError) -> None:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value == 0:
        raise zero_error(f"{name} must be >= 1, got 0")
    if value < 0:
        raise SizeBelowOneError(f"{name} must be >= 1, got {value}")


def validate_initialize_args(args: InitArgs) -> None:
    """Check the arguments of one ``initialize_model_parallel`` call, each naming its parameter."""
    for name in _SIZES:
        _check_size(name, getattr(args, name))
    for name in _OPTIONAL_SIZES:
        if getattr(args, name) is not None:
            _check_size(name, getattr(args, name))
    for name in _FLAGS:
        if not isinstance(getattr(args, name), bool):
            raise TypeError(f"{name} must be a bool, got {getattr(args, name)!r}")
    if args.create_all_gather_group is not None and not isinstance(args.create_all_gather_group, bool):
        raise TypeError(f"create_all_gather_group must be a bool or None, got {args.create_all_gather_group!r}")
    for name in _CALLABLES:
        if getattr(args, name) is not None and not callable(getattr(args, name)):
            raise TypeError(f"{name} must be callable or None, got {getattr(args, name)!r}")

    offset, local = args.rank_offset, args.local_world_size
    if not _is_int(offset):
        raise TypeError(f"rank_offset must be an int >= 0, got {offset!r} ({type(offset).__name__})")
    if local is not None:
        if not _is_int(local):
            raise TypeError(f"local_world_size must be None or an int >= 1, got {local!r} ({type(local).__name__})")
        if local == 0:
            raise ZeroSizeError("local_world_size must be >= 1, got 0")
        if local < 0:
            raise NegativeWorldSizeError(f"local_world_size must be >= 1, got {local}")

    minutes = args.distributed_timeout_minutes
    if isinstance(minutes, bool) or not isinstance(minutes, numbers.Real):
        raise TypeError(f"distributed_timeout_minutes must be a number of minutes, got {minutes!r}")
    # A Real, typed as float: typeshed's numbers.Real lacks the operators used below.
    minutes = cast(float, minutes)
    if not minutes > 0:
        raise ValueError(f"distributed_timeout_minutes must be > 0, got {minutes}")
    try:
        timedelta(minutes=minutes)
    except OverflowError:
        raise OverflowError(f"distributed_timeout_minutes is too large for a timedelta, got {minutes}") from None

    order = args.order
    if not isinstance(order, str):
        raise OrderTypeError(f"order must be a str such as 'tp-cp-ep-dp-pp', got {order!r}")

    hcp = args.hierarchical_context_parallel_sizes
    if hcp is not None:
        if isinstance(hcp, (str, bytes)) or not isinstance(hcp, Sequence):
            raise TypeError(f"hierarchical_context_parallel_sizes must be a list of ints, got {hcp!r}")
        for i, size in enumerate(hcp):
            _check_size(f"hierarchical_context_parallel_sizes[{i}]", size, ZeroHierarchicalSizeError)

    groups = args.high_priority_stream_groups
    if groups is not None:
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise TypeError(f"high_priority_stream_groups must be a list of group names, got {groups!r}")
        for name in groups:
            if not isinstance(name, str):
                raise TypeError(f"high_priority_stream_groups entries must be str, got {name!r}")

    backend = args.pipeline_model_parallel_comm_backend
    if backend is not None and not isinstance(backend, str):
        raise BackendTypeError(f"pipeline_model_parallel_comm_backend must be None or a str, got {backend!r}")

    for name in ("encoder_tensor_model_parallel_size", "encoder_pipeline_model_parallel_size"):  # 0.12-0.13
        value = getattr(args, name)
        if value is None and name == "encoder_pipeline_model_parallel_size":
            continue
        if not _is_int(value):
            raise TypeError(f"{name} must be an int >= 0 (0: no encoder), got {value!r} ({type(value).__name__})")
        if value < 0:
            raise SizeBelowOneError(f"{name} must be >= 0 (0: no encoder), got {value}")
    split = args.pipeline_model_parallel_split_rank
    if split is not None and not _is_int(split):
        raise TypeError(
            f"pipeline_model_parallel_split_rank must be None or an int, got {split!r} ({type(split).__name__})"
        )

    path = args.nccl_communicator_config_path
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"nccl_communicator_config_path must be a path or None, got {path!r}")
    if path is not None and not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "nccl_communicator_config_path: no such file", os.fspath(path))
