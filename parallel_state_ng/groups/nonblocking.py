"""NCCL's nonblocking init under the failure bound: torch's own wait, bounded before any split.

With nonblocking NCCL communicators (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``, or a default group
made with ``pg_options.config.blocking = 0``) torch does not wait for a split inside NCCL: it
polls the communicator's state, and gives up after ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` seconds
(``nccl_nonblocking_timeout()`` in torch's ``torch/csrc/distributed/c10d/NCCLUtils.cpp``: 30
minutes when unset; an integer read with ``std::stoi``, once per process, at the first wait on a
nonblocking communicator). The split's ``timeout`` is not read there. A survivor of a rank that
dies in the split sequence would therefore wait up to 30 minutes, far past the failure bound
(``PSNG_FAILURE_TIMEOUT``, :mod:`~parallel_state_ng.groups.liveness`).

Because torch reads the variable once per process, and with a device-bound default group
already inside ``init_process_group``, a build cannot change it: :func:`check_nonblocking_bound`
refuses, before any group, a nonblocking world whose wait is unset or longer than
:func:`max_nonblocking_timeout` allows; :func:`prepare_nonblocking_timeout`, called before
``init_process_group``, sets it from the bound. A split waits at most twice (on the parent's
state, then for the child's handle), each up to the timeout plus one second (torch compares
whole seconds), then the failing rank waits its grace for the others' records: hence
``2 (T + 1) + grace <= bound``. docs/results/gpus.md, "A rank's death with nonblocking NCCL init".
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups import liveness
from parallel_state_ng.layout.bounded_input import shown

__all__ = [
    "ENV_NONBLOCKING",
    "ENV_NONBLOCKING_TIMEOUT",
    "TORCH_DEFAULT_TIMEOUT_S",
    "NonblockingBoundError",
    "nonblocking_mode",
    "max_nonblocking_timeout",
    "nonblocking_timeout_setting",
    "check_nonblocking_bound",
    "prepare_nonblocking_timeout",
]

#: torch's switch for nonblocking NCCL communicators: ``1`` on, ``0`` off (``c10::utils::check_env``:
#: any other value is ignored with a warning, i.e. off).
ENV_NONBLOCKING = "TORCH_NCCL_USE_COMM_NONBLOCKING"
#: Seconds torch waits for a nonblocking communicator (read once per process, at its first wait).
ENV_NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
#: torch's wait when :data:`ENV_NONBLOCKING_TIMEOUT` is unset (``NCCLUtils.cpp``: 30 × 60).
TORCH_DEFAULT_TIMEOUT_S = 1800
#: NCCL's "unset" value of an int config field (``NCCL_CONFIG_UNDEF_INT``, INT_MIN).
_NCCL_UNDEF_INT = -(2**31)
#: The one torch release that picked nonblocking communicators by itself for a device-bound
#: default group (``ProcessGroupNCCL::useNonblocking``, disabled again in 2.7.1: pytorch#153960).
_AUTO_NONBLOCKING_TORCH = "2.7.0"


class NonblockingBoundError(ValueError):
    """Nonblocking NCCL init whose wait the failure bound cannot hold (raised before any split)."""


def _default_blocking_config() -> int | None:
    """``config.blocking`` of the default group's NCCL options (``None``: unset or unknown)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        import torch

        default: Any = dist.distributed_c10d._get_default_group()
        backend = default._get_backend(torch.device("cuda"))
        value = int(backend.options.config.blocking)
    except Exception:  # noqa: BLE001 - no NCCL backend (gloo, a CPU build): unknown
        return None
    return None if value == _NCCL_UNDEF_INT else value


def nonblocking_mode() -> bool:
    """Whether torch makes this process's NCCL communicators nonblocking, as torch decides it.

    torch's order (``ProcessGroupNCCL::useNonblocking``): the default group's own
    ``config.blocking`` when set, else :data:`ENV_NONBLOCKING` (``1`` on, ``0`` off), else off,
    except on torch 2.7.0, which turned it on for a device-bound default group.
    """
    configured = _default_blocking_config()
    if configured is not None:
        return configured == 0
    text = os.environ.get(ENV_NONBLOCKING)
    if text in ("0", "1"):
        return text == "1"
    if dist.is_available() and dist.is_initialized():
        import torch

        default: Any = dist.distributed_c10d._get_default_group()
        bound = getattr(default, "bound_device_id", None) is not None
        return bound and torch.__version__.split("+")[0] == _AUTO_NONBLOCKING_TORCH
    return False


def max_nonblocking_timeout(bound: float) -> int:
    """The longest :data:`ENV_NONBLOCKING_TIMEOUT` (whole seconds) the failure bound ``bound`` holds.

    ``floor((bound - grace) / 2) - 1`` (module docstring); below 1 no setting holds the bound.
    """
    return math.floor((bound - liveness.grace_seconds(bound)) / 2) - 1


def nonblocking_timeout_setting() -> int | None:
    """:data:`ENV_NONBLOCKING_TIMEOUT` as torch will read it: ``None`` when unset or blank.

    Raises:
        NonblockingBoundError: not a whole number of seconds (torch's ``std::stoi`` would throw
            on it, or silently drop a fraction).
    """
    text = os.environ.get(ENV_NONBLOCKING_TIMEOUT, "").strip()
    if not text:
        return None
    if not text.lstrip("+-").isdigit():
        raise NonblockingBoundError(
            f"environment variable {ENV_NONBLOCKING_TIMEOUT} must be a whole number of seconds "
            f"(torch reads it with std::stoi), got {shown(text)}"
        )
    return int(text)


def _problem(bound: float, value: int | None) -> str | None:
    """Why ``value`` (the setting) does not hold ``bound``; ``None`` when it does."""
    limit = max_nonblocking_timeout(bound)
    if limit < 1:
        return "the failure bound is too short for nonblocking NCCL: torch counts its wait in whole seconds"
    if value is None:
        return f"{ENV_NONBLOCKING_TIMEOUT} is unset, so torch waits {TORCH_DEFAULT_TIMEOUT_S} s"
    if value < 1:
        return f"{ENV_NONBLOCKING_TIMEOUT}={value}: torch gives up on the first wait (at most 1 s), even when healthy"
    if value > limit:
        return f"{ENV_NONBLOCKING_TIMEOUT}={value} s is longer than the bound allows ({limit} s)"
    return None


def _advice(bound: float) -> str:
    limit = max_nonblocking_timeout(bound)
    fix = (
        f"set {ENV_NONBLOCKING_TIMEOUT} to a whole number from 1 to {limit} in every rank's environment before "
        f"init_process_group (parallel_state_ng.groups.nonblocking.prepare_nonblocking_timeout() does it), "
        if limit >= 1
        else ""
    )
    return (
        f"{fix}raise {liveness.ENV_FAILURE_TIMEOUT}, or set it to 0 to turn the bound off (survivors then wait "
        f"as long as torch does)"
    )


def check_nonblocking_bound() -> None:
    """Refuse a nonblocking NCCL world whose waits the failure bound cannot hold; a no-op otherwise.

    Called when a build takes the split path (:func:`~parallel_state_ng.groups.split.creation_path`),
    before any group, and again before every split (O(1): a few environment reads): with the bound on
    (``PSNG_FAILURE_TIMEOUT`` > 0) and :func:`nonblocking_mode`, :data:`ENV_NONBLOCKING_TIMEOUT`
    must be a whole number from 1 to :func:`max_nonblocking_timeout`. torch has read it already
    (or will, at its first wait, whatever is set later), so it is checked, never changed here.

    Raises:
        NonblockingBoundError: the setting is unset, not a number, below 1 or over the limit;
            the message names both variables, the values and the fix.
    """
    bound = liveness.failure_timeout()
    if bound <= 0 or not nonblocking_mode():
        return
    value = nonblocking_timeout_setting()
    problem = _problem(bound, value)
    if problem is not None:
        raise NonblockingBoundError(
            f"nonblocking NCCL init with the failure bound {liveness.ENV_FAILURE_TIMEOUT}={bound:g} s: torch waits "
            f"for a nonblocking communicator up to {ENV_NONBLOCKING_TIMEOUT} seconds, not the split's timeout, so "
            f"survivors of a rank that dies in a split would not raise within the bound: {problem}. "
            f"{_advice(bound)}"
        )


def prepare_nonblocking_timeout() -> int | None:
    """Before ``init_process_group``: give nonblocking NCCL a wait the failure bound holds.

    When the environment asks for nonblocking communicators (:data:`ENV_NONBLOCKING` ``=1``)
    and the bound is on, sets :data:`ENV_NONBLOCKING_TIMEOUT` to :func:`max_nonblocking_timeout`
    if it is unset, and checks it otherwise. Returns the value in force (``None``: nothing to
    bound). Call it in every rank before torch's first nonblocking wait (torch reads it once).

    Raises:
        NonblockingBoundError: a value already set does not hold the bound (it is not overwritten).
    """
    bound = liveness.failure_timeout()
    if bound <= 0 or os.environ.get(ENV_NONBLOCKING) != "1":
        return None
    value = nonblocking_timeout_setting()
    if value is None and max_nonblocking_timeout(bound) >= 1:
        value = max_nonblocking_timeout(bound)
        os.environ[ENV_NONBLOCKING_TIMEOUT] = str(value)
    problem = _problem(bound, value)
    if problem is not None:
        raise NonblockingBoundError(
            f"{ENV_NONBLOCKING}=1 with {liveness.ENV_FAILURE_TIMEOUT}={bound:g} s: {problem}. {_advice(bound)}"
        )
    return value
