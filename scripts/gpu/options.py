"""The GPU check's NCCL-options part: what torch is asked to create, under MCore and under compat.

:func:`compare_options` runs MCore's and compat's ``initialize_model_parallel`` with the same
communicator YAML and ``high_priority_stream_groups``, records every ``new_group`` /
``split_group`` call (ranks, backend, ``pg_options``, timeout, ``group_desc``) and compares the
two records. Without NCCL (the CPU dry run) a stand-in ``ProcessGroupNCCL.Options`` is used.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

#: The communicator config written for the check (MCore's YAML keys; several group kinds).
NCCL_YAML = """\
tp:
  cga_cluster_size: 2
  max_ctas: 16
  min_ctas: 4
dp:
  max_ctas: 8
  is_high_priority_stream: true
pp:
  min_ctas: 2
  max_ctas: 24
ep:
  cga_cluster_size: 4
  max_ctas: 32
"""
#: Group names whose streams get high priority on top of the YAML.
HIGH_PRIORITY = ["tp", "cp"]
_CONFIG_KEYS = ("cga_cluster_size", "max_ctas", "min_ctas")


class _StandInConfig:
    """The fields of NCCL's config that MCore's YAML sets (CPU dry run)."""

    def __init__(self) -> None:
        self.cga_cluster_size = self.max_ctas = self.min_ctas = -1
        self.net_name = ""


class StandInOptions:
    """A stand-in for ``torch.distributed.ProcessGroupNCCL.Options`` on a CPU build of torch."""

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self.config = _StandInConfig()


@contextlib.contextmanager
def nccl_options_available() -> Iterator[bool]:
    """Inside: ``torch.distributed.ProcessGroupNCCL.Options`` exists; yields whether it is NCCL's own."""
    if hasattr(dist, "ProcessGroupNCCL"):
        yield True
        return
    setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=StandInOptions))  # noqa: B010 (mypy)
    try:
        yield False
    finally:
        delattr(dist, "ProcessGroupNCCL")


def describe_options(options: Any) -> str:
    """``pg_options`` as text: ``-`` for none, else the high-priority flag and the config fields set."""
    if options is None:
        return "-"
    parts = [f"hp={bool(getattr(options, 'is_high_priority_stream', False))}"]
    config = getattr(options, "config", None)
    for key in _CONFIG_KEYS:
        parts.append(f"{key}={getattr(config, key, '?')}")
    return " ".join(parts)


@contextlib.contextmanager
def recording(real_options: bool) -> Iterator[list[dict[str, Any]]]:
    """Inside: every ``new_group`` / ``split_group`` call is recorded in the yielded list.

    Without NCCL (``real_options`` false) the stand-in options are recorded and not passed on.
    """
    calls: list[dict[str, Any]] = []
    saved = {name: getattr(dist, name) for name in ("new_group", "split_group") if hasattr(dist, name)}

    depth = [0]  # a creation call made inside another (the CPU split stand-in's) is not the caller's

    def wrap(name: str, real: Any) -> Any:
        def recorder(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return real(*args, **kwargs)
            if name == "new_group":
                ranks = kwargs.get("ranks", args[0] if args else None)
            else:
                split = kwargs.get("split_ranks", args[1] if len(args) > 1 else None) or []
                here = dist.get_rank()
                ranks = next((list(r) for r in split if here in r), split[0] if split else None)  # this rank's colour
            timeout = kwargs.get("timeout")
            member = ranks is None or dist.get_rank() in list(ranks)
            calls.append(
                {
                    "call": name,
                    "desc": kwargs.get("group_desc") or "-",
                    "backend": str(kwargs.get("backend") or "default"),
                    "ranks": str(list(ranks) if ranks is not None else "world"),
                    "options": describe_options(kwargs.get("pg_options")),
                    "timeout": "-" if timeout is None else str(timeout),
                    "member": member,
                }
            )
            if not real_options:
                kwargs.pop("pg_options", None)
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        return recorder

    for name, real in saved.items():
        setattr(dist, name, wrap(name, real))
    try:
        yield calls
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


def registered_groups() -> int:
    """Process groups in torch's registry, the default group included."""
    return len(dist.distributed_c10d._world.pg_map)


#: Getters whose groups are compared between MCore and compat (a getter MCore leaves unset is skipped).
GETTERS = (
    "get_tensor_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_data_parallel_group",
    "get_context_parallel_group",
    "get_model_parallel_group",
    "get_tensor_and_data_parallel_group",
    "get_embedding_group",
    "get_position_embedding_group",
    "get_expert_model_parallel_group",
    "get_expert_tensor_parallel_group",
    "get_expert_data_parallel_group",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_data_parallel_group_gloo",
)


def memberships(ps: Any) -> dict[str, list[int] | None]:
    """Each getter's group as its global ranks (``None``: the getter raised or returned no group)."""
    out: dict[str, list[int] | None] = {}
    for name in GETTERS:
        getter = getattr(ps, name, None)
        if getter is None:
            continue
        try:
            group = getter()
        except Exception:  # noqa: BLE001 - a group this release or layout leaves unset
            group = None
        out[name] = None if group is None else list(dist.get_process_group_ranks(group))
    return out


def _init_args(yaml_path: str, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        **(sizes or {}),
        "nccl_communicator_config_path": yaml_path,
        "high_priority_stream_groups": list(HIGH_PRIORITY),
        "distributed_timeout_minutes": 7,
    }


def free_device_mib(device: str) -> int | None:
    """Free memory of the CUDA device in MiB (``None`` on the CPU)."""
    if device == "cpu":
        return None
    return torch.cuda.mem_get_info()[0] // 2**20


def touch_groups(before: set[Any], device: str) -> int:
    """One all-reduce on every group created since ``before`` (a lazy NCCL group makes its
    communicator then); the number of groups touched. Raises when a sum is wrong.
    """
    touched = 0
    # in creation order, which every member shares (a set's order differs between ranks: a hang)
    for group in [g for g in dist.distributed_c10d._world.pg_map if g not in before]:
        on = device if dist.get_backend(group) == "nccl" else "cpu"
        value = torch.ones(1, device=on)
        dist.all_reduce(value, group=group)
        if float(value) != dist.get_world_size(group):
            raise RuntimeError(f"all-reduce over {dist.get_process_group_ranks(group)} gave {float(value)}")
        touched += 1
    return touched


def _run(
    ps: Any, yaml_path: str, real_options: bool, device: str | None = None, sizes: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], dict]:
    """One implementation's init under the recorder, then its destroy; (calls, group counts).

    With ``device``, every group made is used once before the destroy and the counts include
    the device's free memory at each point (``free_mib_*``).
    """
    counts: dict[str, Any] = {"before": registered_groups()}
    before = set(dist.distributed_c10d._world.pg_map)
    if device is not None:
        counts["free_mib_before"] = free_device_mib(device)
    with recording(real_options) as calls:
        ps.initialize_model_parallel(**_init_args(yaml_path, sizes))
    counts["after_init"] = registered_groups()
    counts["members"] = memberships(ps)
    if device is not None:
        counts["touched"] = touch_groups(before, device)
        counts["free_mib_after_init"] = free_device_mib(device)
    ps.destroy_model_parallel()
    counts["after_destroy"] = registered_groups()
    if device is not None:
        counts["free_mib_after_destroy"] = free_device_mib(device)
    return calls, counts


def _leftovers(before: set[Any]) -> int:
    """Destroy the groups created since ``before`` (MCore's leaks); how many there were."""
    leaked = set(dist.distributed_c10d._world.pg_map) - before
    for group in leaked:
        dist.destroy_process_group(group)
    return len(leaked)


def _key(call: dict[str, Any]) -> tuple[str, str, str]:
    return call["desc"], call["backend"], call["ranks"]


def compare_options(workdir: str, device: str, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    """MCore's and compat's group creation calls under the same options, side by side.

    ``sizes``: more arguments of ``initialize_model_parallel`` (the parallel sizes; default
    none: world size 1).
    compat runs with group sharing off, so that it makes every group MCore makes.
    Returns ``rows`` (desc, backend, ranks, MCore's options/timeout, compat's, whether they
    agree), ``mismatches``, the calls per side, compat's group counts (``before``,
    ``after_init``, ``after_destroy``; compat's groups are each used once on ``device`` before
    the destroy) and ``mcore_leaked`` (groups MCore's destroy left).
    """
    os.makedirs(workdir, exist_ok=True)
    yaml_path = os.path.join(workdir, "nccl_comm.yaml")  # the same path on every rank of a world
    part = f"{yaml_path}.{os.getpid()}"
    with open(part, "w", encoding="utf-8") as stream:
        stream.write(NCCL_YAML)
    os.replace(part, yaml_path)  # atomic: another rank never reads a part-written file
    import megatron.core.parallel_state as mcore_ps

    import compat.parallel_state as compat_ps
    from parallel_state_ng.groups.sharing import set_group_sharing

    with nccl_options_available() as real:
        before = set(dist.distributed_c10d._world.pg_map)
        mcore_calls, mcore_counts = _run(mcore_ps, yaml_path, real, sizes=sizes)
        mcore_leaked = _leftovers(before)
        # every group made as MCore makes it: sharing off (unset, the split path shares under safe)
        previous = set_group_sharing("off")
        try:
            compat_calls, counts = _run(compat_ps, yaml_path, real, device, sizes)
        finally:
            set_group_sharing(previous)
    theirs, ours = mcore_counts["members"], counts.pop("members")
    member_mismatches = {g: (theirs[g], ours.get(g)) for g in theirs if theirs[g] != ours.get(g)}
    mine: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    compat_calls = [call for call in compat_calls if call["member"]]  # a split this rank joins without a colour
    for call in compat_calls:
        mine.setdefault(_key(call), []).append(call)
    rows, mismatches = [], 0
    seen: Counter[tuple[str, str, str]] = Counter()
    # MCore creates every group on every rank; compat only the rank's own: compare the calls for
    # groups this rank is a member of.
    mcore_calls = [call for call in mcore_calls if call["member"]]
    for call in mcore_calls:
        key = _key(call)
        ours = mine.get(key, [])
        other = ours[seen[key]] if seen[key] < len(ours) else None
        seen[key] += 1
        same = other is not None and (other["options"], other["timeout"]) == (call["options"], call["timeout"])
        mismatches += not same
        rows.append({**call, "compat": other, "same": same})
    for key, calls in mine.items():
        for call in calls[seen[key] :]:
            mismatches += 1
            rows.append({**call, "options": "(not created)", "timeout": "-", "compat": call, "same": False})
    return {
        "real_nccl_options": real,
        "rows": rows,
        "mismatches": mismatches,
        "mcore_calls": len(mcore_calls),
        "compat_calls": len(compat_calls),
        "compat_calls_by_kind": dict(Counter(c["call"] for c in compat_calls)),
        "counts": counts,
        "mcore_leaked": mcore_leaked,
        "getters_compared": len(theirs),
        "member_mismatches": member_mismatches,
    }


def options_table(result: dict[str, Any]) -> list[str]:
    """The comparison as text lines: one row per MCore creation call (and each of compat's extra)."""
    lines = [f"{'group_desc':<44} {'backend':<8} {'ranks':<6} {'MCore options / timeout':<58} compat"]
    for row in result["rows"]:
        mine = row["compat"]
        theirs = f"{row['options']} / {row['timeout']}"
        if mine is None:
            ours = "(not created)"
        else:
            ours = "same" if row["same"] else f"{mine['options']} / {mine['timeout']}"
        lines.append(f"{row['desc']:<44} {row['backend']:<8} {row['ranks']:<6} {theirs:<58} {ours}")
    return lines
