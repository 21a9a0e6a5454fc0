"""Counting the process groups a piece of code asks torch for: :class:`NewGroupCalls`.

Benchmarks and tests compare how many ``torch.distributed.new_group`` calls one rank makes
(ours: the rank's own groups; Megatron-Core's: every group of the world on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["NewGroupCalls"]


class NewGroupCalls:
    """Inside ``with NewGroupCalls() as calls:``, every ``new_group`` call is counted in ``calls.calls``.

    Both names are wrapped, ``torch.distributed.new_group`` and
    ``torch.distributed.distributed_c10d.new_group`` (what torch's subgroup helpers call), and
    both are put back on exit, also after an exception. The calls still create their groups.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._original: Callable[..., Any] | None = None

    def __enter__(self) -> NewGroupCalls:
        if self._original is not None:
            raise RuntimeError("this NewGroupCalls is already counting; use a new one per with-block")
        original = self._original = dist.distributed_c10d.new_group

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        dist.new_group = dist.distributed_c10d.new_group = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.new_group = dist.distributed_c10d.new_group = self._original  # type: ignore[assignment]
        self._original = None
