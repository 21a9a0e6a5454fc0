"""Up-front checks of ``initialize_model_parallel`` arguments: the engine's, shared with its builders.

See :mod:`parallel_state_ng.layout.validate` (the checks and their MCore-compatible error types).
"""

from __future__ import annotations

from parallel_state_ng.layout.validate import (
    BackendTypeError,
    NegativeWorldSizeError,
    OrderTypeError,
    SizeBelowOneError,
    ZeroHierarchicalSizeError,
    ZeroSizeError,
    validate_initialize_args,
)

__all__ = [
    "validate_initialize_args",
    "ZeroSizeError",
    "SizeBelowOneError",
    "ZeroHierarchicalSizeError",
    "NegativeWorldSizeError",
    "OrderTypeError",
    "BackendTypeError",
]
