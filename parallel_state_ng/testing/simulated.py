"""One simulated rank of any world: torch's fake backend in this process (and the argument checks
the worlds share).

:func:`simulated_rank` (a context manager) and :func:`init_simulated_rank` make this process rank
``rank`` of a ``world_size``-rank world: no peers, no processes, any size. Groups are created as
on a real rank and collectives do nothing. Public through :mod:`parallel_state_ng.testing.worlds`.

The fake backend cannot create a gloo group (torch 2.13 fails an internal assert, 2.14 crashes
the process), yet Megatron asks for gloo twins by default. A simulated world therefore gives
every gloo group asked for on it (through ``torch.distributed.new_group``, by compat, by
Megatron itself or by user code) a stand-in: a fake-backend group over the same ranks, with the
same rank, size, rank list and name bookkeeping; ``get_backend`` says ``"fake"`` for it.
:func:`install_gloo_stand_in` is that hook (docs/testing.md, "Simulated worlds").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

#: What a stand-in replaces: a gloo backend in a backend string ("gloo", "cpu:gloo,cuda:nccl").
_GLOO = re.compile(r"\bgloo\b", flags=re.I)
_STAND_IN_MARK = "_psng_gloo_stand_in"


def check_int(name: str, value: Any, low: int, high: int | None = None, high_name: str = "") -> int:
    """``value`` as an int in ``[low, high)``; a TypeError / ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high_name}={high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a positive, finite number of seconds; an error naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")
    return float(value)


def _existing(dist: Any) -> str:
    """The default process group that exists, described."""
    return (
        f"a default process group already exists (backend {dist.get_backend()!r}, rank {dist.get_rank()} "
        f"of {dist.get_world_size()})"
    )


def destroy_simulated_world() -> None:
    """Destroy the default process group (and every group over it) and what torch keeps of its meshes.

    Before torch 2.10 (``TORCH_FACTS["device_mesh_flatten_mapping"]``) a DeviceMesh's flattened
    dims and sub-meshes are kept process-wide, under their root mesh, and meshes compare by value:
    a mesh of the next world equal to one of this world would find this world's flattened dims,
    whose groups are destroyed here. Those records are dropped with the world.
    """
    import torch.distributed as dist

    from parallel_state_ng.groups.torch_support import torch_has

    if dist.is_initialized():
        dist.destroy_process_group()
    if not torch_has("device_mesh_flatten_mapping"):
        from torch.distributed import device_mesh

        resources = getattr(device_mesh, "_mesh_resources", None)
        for table in ("child_to_root_mapping", "root_to_flatten_mapping", "flatten_name_to_root_dims"):
            records = getattr(resources, table, None)
            if isinstance(records, dict):
                records.clear()


def init_simulated_rank(rank: int, world_size: int, *, replace: bool = False) -> None:
    """Initialize the default process group as rank ``rank`` of a ``world_size``-rank fake world.

    The caller destroys it (:func:`destroy_simulated_world`); :func:`simulated_rank` does that for
    a ``with`` block. ``replace=True`` first destroys any default group (and every group made over
    it); otherwise an existing default group is refused.

    Raises:
        TypeError, ValueError: ``rank`` or ``world_size`` is not an int, ``world_size < 1``, or
            ``rank`` is outside ``[0, world_size)``.
        RuntimeError: a default process group exists and ``replace`` is false.
    """
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, world_size, "world_size")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if not replace:
            raise RuntimeError(
                f"{_existing(dist)}: destroy it first (torch.distributed.destroy_process_group()) or pass replace=True"
            )
        destroy_simulated_world()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    install_gloo_stand_in()


def _on_fake_world(c10d: Any) -> bool:
    default = c10d._world.default_pg
    return default is not None and str(c10d._world.pg_map.get(default, ("",))[0]) == "fake"


def _stand_in(original: Callable[..., Any], c10d: Any) -> Callable[..., Any]:
    # Where ``backend`` sits among the positional parameters: found once, not per call (a world
    # of 1,024 simulated ranks under MCore creates hundreds of thousands of groups).
    parameters = inspect.signature(original).parameters
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [name for name, p in parameters.items() if p.kind in kinds]
    index = positional.index("backend") if "backend" in positional else None

    @functools.wraps(original)
    def helper(*args: Any, **kwargs: Any) -> Any:
        at = -1 if "backend" in kwargs or index is None or len(args) <= index else index
        backend = args[at] if at >= 0 else kwargs.get("backend")
        if backend is not None and _GLOO.search(str(backend)) and _on_fake_world(c10d):
            stand_in = c10d.Backend(_GLOO.sub("fake", str(backend)))
            if at >= 0:
                args = (*args[:at], stand_in, *args[at + 1 :])
            else:
                kwargs["backend"] = stand_in
        return original(*args, **kwargs)

    setattr(helper, _STAND_IN_MARK, True)
    return helper


def install_gloo_stand_in() -> bool:
    """Make every gloo group created while the default group is a fake-backend one a stand-in.

    Idempotent and process-wide (it wraps torch's group-creation helper, which every
    ``new_group`` goes through); a world of another backend is untouched: a gloo group there is
    torch's own. The stand-in is a fake-backend group over the same ranks (``"cpu:gloo"`` in a
    backend string becomes ``"cpu:fake"``), so its collectives do nothing, as on the fake world.

    Returns whether the stand-in is in place: false where this torch has no
    ``_new_process_group_helper`` with a ``backend`` argument (every release from 2.4 to 2.14
    has one; ``parallel_state_ng.groups.torch_support`` reports it). There a gloo group on a
    fake world stays torch's own failure: pass ``create_gloo_process_groups=False``.
    """
    import torch.distributed.distributed_c10d as c10d

    original = getattr(c10d, "_new_process_group_helper", None)
    if original is not None and getattr(original, _STAND_IN_MARK, False):
        return True
    if original is None or "backend" not in inspect.signature(original).parameters:
        return False
    c10d._new_process_group_helper = _stand_in(original, c10d)
    return True


@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int) -> Iterator[Any]:
    """This process is rank ``rank`` of a ``world_size``-rank world (fake backend) inside the block.

    Yields the default process group. On exit the default group and every group made over it
    are destroyed, whatever the block did. A default group that exists before the block is
    refused (RuntimeError): the block would destroy a group it did not make.

        with simulated_rank(5, 8):
            assert torch.distributed.get_rank() == 5

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`init_simulated_rank` without ``replace``.
    """
    import torch.distributed as dist

    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, world_size, "world_size")
    if dist.is_initialized():
        raise RuntimeError(
            f"simulated_rank({rank}, {world_size}) would destroy a group it did not make: {_existing(dist)}; "
            "destroy it first (torch.distributed.destroy_process_group())"
        )
    init_simulated_rank(rank, world_size)
    try:
        yield dist.group.WORLD
    finally:
        destroy_simulated_world()
