"""Checking a shape and its dim names: where every layout and grid starts.

Pure: no ``torch``. Errors name the parameter and the value (``shape[2] (dim 'dp')``).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

from parallel_state_ng.layout.bounded_input import MAX_RANK

__all__ = ["check_int", "short_list", "validate_dims"]


def check_int(value: object, what: str, *, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; ``what`` names it in the error.

    Raises:
        TypeError: not an integer (bools and floats included).
        ValueError: below ``minimum``.
    """
    if type(value) is not int:  # the common case skips the (slow) abstract-class checks
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
        value = int(value)
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def short_list(values: Sequence[int], shown: int = 8) -> str:
    """The first ``shown`` of ``values`` for an error message (huge ones as powers of two)."""
    head = ", ".join(str(v) if v < 2**64 else f"~2**{v.bit_length() - 1}" for v in values[:shown])
    return f"[{head}{', ...' if len(values) > shown else ''}]"


def validate_dims(shape: Sequence[int], dim_names: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Check a (shape, dim_names) pair and return them as tuples of ints and strs.

    Raises ``ValueError`` for a length mismatch, an empty or duplicated name, or a size < 1,
    and ``TypeError`` for a size that is not an int (bools and floats included).
    """
    if type(shape) not in (list, tuple) and (isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable)):
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    if type(dim_names) not in (list, tuple) and (
        isinstance(dim_names, (str, bytes)) or not isinstance(dim_names, Iterable)
    ):
        raise TypeError(f"dim_names must be a sequence of str, got {dim_names!r}")
    shape, dim_names = list(shape), list(dim_names)
    if len(shape) != len(dim_names):
        raise ValueError(
            f"len(shape) {len(shape)} != len(dim_names) {len(dim_names)}: shape={shape}, dim_names={dim_names}"
        )
    sizes = tuple(check_int(s, f"shape[{i}] (dim {dim_names[i]!r})", minimum=1) for i, s in enumerate(shape))
    ranks = 1
    for i, size in enumerate(sizes):  # stops at the first size over the limit: no huge product
        ranks *= size
        if ranks > MAX_RANK:
            raise ValueError(
                f"shape {short_list(sizes)} covers more than {MAX_RANK} (2**62) ranks, the limit of a layout "
                f"(over it at shape[{i}])"
            )
    for i, name in enumerate(dim_names):
        if not isinstance(name, str) or not name:
            raise ValueError(f"dim_names[{i}] must be a non-empty str, got {name!r}")
    seen = set()
    for name in dim_names:
        if name in seen:
            raise ValueError(f"dim_names has duplicate name {name!r}: {dim_names}")
        seen.add(name)
    return sizes, tuple(dim_names)
