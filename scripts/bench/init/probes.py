"""Measurement probes of the init benchmark (:mod:`scripts.bench.init.cost`): memory,
``new_group`` calls, the groups handed out.

* memory: :func:`rss_bytes`, :func:`peak_bytes` (``/proc/self/status``, ``ru_maxrss`` where
  that is missing) and :func:`reset_peak` (``/proc/self/clear_refs``);
* :class:`NewGroupCounter` counts ``torch.distributed.new_group`` calls; :data:`GETTERS` and
  :func:`getter_digests` hash what every group getter returns, to compare two modules;
  :func:`module_state_names`: a module's parallel-state globals. No torch import here: the
  callers pass ``torch.distributed`` in. See scripts/README.md.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = [
    "GETTERS",
    "status_kb",
    "reset_peak",
    "rss_bytes",
    "peak_bytes",
    "NewGroupCounter",
    "digest",
    "getter_digests",
    "module_state_names",
]

# (label, getter name, keyword arguments): every group getter both modules share.
GETTERS: list[tuple[str, str, dict[str, Any]]] = [
    ("tp", "get_tensor_model_parallel_group", {}),
    ("pp", "get_pipeline_model_parallel_group", {}),
    ("mp", "get_model_parallel_group", {}),
    ("dp", "get_data_parallel_group", {}),
    ("dp_cp", "get_data_parallel_group", {"with_context_parallel": True}),
    ("dp_cp_partial", "get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}),
    ("cp", "get_context_parallel_group", {}),
    ("embd", "get_embedding_group", {}),
    ("pos_embd", "get_position_embedding_group", {}),
    ("tp_dp", "get_tensor_and_data_parallel_group", {}),
    ("tp_dp_cp", "get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("tp_cp", "get_tensor_and_context_parallel_group", {}),
    ("ep", "get_expert_model_parallel_group", {}),
    ("ep_tp", "get_expert_tensor_parallel_group", {}),
    ("tp_ep_mp", "get_expert_tensor_and_model_parallel_group", {}),
    ("tp_ep_pp", "get_expert_tensor_model_pipeline_parallel_group", {}),
    ("ep_dp", "get_expert_data_parallel_group", {}),
    ("ep_dp_partial", "get_expert_data_parallel_group", {"partial_expert_data_parallel": True}),
    ("intra_dist_opt", "get_intra_distributed_optimizer_instance_group", {}),
]


def status_kb(key: str) -> int | None:
    """The value of ``key`` in ``/proc/self/status`` (in kB), or ``None`` where not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    """This process's resident set size (``VmRSS``; falls back to ``ru_maxrss``), in bytes."""
    kb = status_kb("VmRSS")
    if kb is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kb * 1024


def peak_bytes() -> int:
    """This process's peak resident set size (``VmHWM``; falls back to ``ru_maxrss``), in bytes."""
    kb = status_kb("VmHWM")
    if kb is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kb * 1024


class NewGroupCounter:
    """Wraps ``torch.distributed.new_group``; counts calls and their synchronization mode."""

    def __init__(self, dist: Any) -> None:
        self.dist = dist
        self.original = dist.new_group
        self.calls = 0
        self.local_sync = 0
        dist.new_group = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Count the call, then make the group as ``new_group`` would."""
        self.calls += 1
        if kwargs.get("use_local_synchronization", False):
            self.local_sync += 1
        return self.original(*args, **kwargs)

    def reset(self) -> None:
        """Zero the counts."""
        self.calls = self.local_sync = 0


def digest(dist: Any, group: Any) -> str:
    """``group``'s size and a short hash of its ranks: ``"<size>:<sha1 prefix>"``."""
    ranks = dist.get_process_group_ranks(group)
    return f"{len(ranks)}:{hashlib.sha1(repr(ranks).encode()).hexdigest()[:16]}"


def getter_digests(dist: Any, mod: Any) -> dict[str, str]:
    """Label -> :func:`digest` of the group each of :data:`GETTERS` returns from ``mod`` (or why none)."""
    out = {}
    for label, name, kwargs in GETTERS:
        try:
            group = getattr(mod, name)(**kwargs)
        except AssertionError:
            out[label] = "not initialized"
            continue
        out[label] = "None" if group is None else digest(dist, group)
    return out


def module_state_names(mod: Any) -> dict[str, Any]:
    """The module's private globals that hold None or {} at import (its parallel state)."""
    return {
        k: v for k, v in vars(mod).items() if k.startswith("_") and not k.startswith("__") and (v is None or v == {})
    }
