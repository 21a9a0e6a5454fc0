"""The world a launcher started this process in: torchrun's or srun's variables, and joining it.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``);
``srun`` sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, and the job script sets
``MASTER_ADDR``/``MASTER_PORT``. :func:`launched_world` reads them (torchrun's first), and
:func:`join` joins that world: NCCL on ``cuda:LOCAL_RANK`` when CUDA is available, gloo on the
CPU otherwise; ``bind_device=True`` passes ``device_id`` (an eagerly initialized default group
bound to the device, where torch creates groups by splitting it). The examples (demo,
train_gpt) join the launcher's world when there is one and start their own processes when there
is none. Importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")


class LauncherError(ValueError):
    """The launcher's variables cannot describe a world, or the world cannot be joined as asked."""


@dataclass(frozen=True)
class LaunchedWorld:
    """This process's place in the launcher's world."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun" or "srun"

    @property
    def size_source(self) -> str:
        """The variable that gave the world size, with its value (for error messages)."""
        name = "WORLD_SIZE" if self.launcher == "torchrun" else "SLURM_NTASKS"
        return f"{name}={self.world_size} from {self.launcher}"


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        value = int(environ[name])
    except ValueError:
        raise LauncherError(f"{name}={environ[name]!r} is not an integer") from None
    if value < 0:
        raise LauncherError(f"{name}={value} is negative")
    return value


def launched_world(environ: Mapping[str, str] | None = None) -> LaunchedWorld | None:
    """The launcher's world from ``environ`` (default ``os.environ``); None when no launcher started us.

    torchrun: ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` all set. srun: ``SLURM_PROCID``,
    ``SLURM_NTASKS`` and ``SLURM_LOCALID`` all set together with ``MASTER_ADDR`` and
    ``MASTER_PORT`` (without them, e.g. a batch script's own process, there is no world to join).

    Raises:
        LauncherError: a value is not a non-negative integer, the world size is 0, or the rank
            is not below it.
    """
    env = os.environ if environ is None else environ
    if all(name in env for name in TORCHRUN_VARS):
        names, launcher = TORCHRUN_VARS, "torchrun"
    elif all(name in env for name in SLURM_VARS + RENDEZVOUS_VARS):
        names, launcher = SLURM_VARS, "srun"
    else:
        return None
    rank, size, local = (_int(env, name) for name in names)
    if size < 1 or rank >= size:
        raise LauncherError(f"{names[0]}={rank} is not a rank of a world of {names[1]}={size}")
    return LaunchedWorld(rank, size, local, launcher)


def check_size(world: LaunchedWorld, wanted: int, what: str) -> None:
    """Refuse a job whose size ``wanted`` (described by ``what``) is not the launcher's world size.

    Raises:
        LauncherError: naming both sizes.
    """
    if wanted != world.world_size:
        raise LauncherError(
            f"{what} needs a world of {wanted} processes, but the launcher started {world.world_size} "
            f"({world.size_source}): start {wanted} processes or change the sizes"
        )


def join(world: LaunchedWorld, *, bind_device: bool = False, use_cuda: bool | None = None, timeout_s: float = 120.0):
    """Initialize the default group of ``world`` (env:// rendezvous); the device this rank computes on.

    ``use_cuda`` (default: whether CUDA is available) picks NCCL on ``cuda:LOCAL_RANK``; otherwise
    gloo on the CPU. ``bind_device`` passes that device as ``device_id`` (eager init).

    Raises:
        LauncherError: ``bind_device`` without CUDA (torch binds a default group to an
            accelerator only), or ``MASTER_ADDR``/``MASTER_PORT`` missing (nothing is initialized).
    """
    import datetime

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    if bind_device and not cuda:
        raise LauncherError("--bind-device needs CUDA: torch binds the default group to an accelerator, not the CPU")
    missing = [name for name in RENDEZVOUS_VARS if name not in os.environ]
    if missing:
        raise LauncherError(f"{' and '.join(missing)} not set: the launcher gave no rendezvous address")
    # env:// reads these; srun sets only its own
    os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.world_size), LOCAL_RANK=str(world.local_rank))
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if cuda:
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
        if bind_device:
            kwargs["device_id"] = device
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method="env://", rank=world.rank, world_size=world.world_size, **kwargs)
    return device
