"""NCCL options fidelity against one megatron-core release: what each group is created with.

:func:`run` (in a process bound to the release, fake backend, simulated ranks) records every
``new_group`` / ``split_group`` call that makes one of the rank's groups (members, desc,
timeout, backend, ``pg_options`` as a dict; :class:`CreationRecorder`), with a stand-in for
``ProcessGroupNCCL`` (CPU torch has none), and compares MCore's ``initialize_model_parallel``
with compat's on the member path and on the split path, per group.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import warnings
from collections import defaultdict
from datetime import timedelta
from typing import Any

#: The fields of ``ProcessGroupNCCL.Options().config`` MCore's ``get_nccl_options`` sets.
CONFIG_FIELDS = ("cga_cluster_size", "max_ctas", "min_ctas", "net_name")


class _StandInConfig:
    """``NCCLConfig`` with only the fields MCore touches (anything else is an AttributeError)."""

    __slots__ = CONFIG_FIELDS


class _StandInOptions:
    __slots__ = ("is_high_priority_stream", "config")

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self.config = _StandInConfig()


class StandInNCCL:
    """Stands in for ``torch.distributed.ProcessGroupNCCL``: only ``Options``."""

    Options = _StandInOptions


def options_dict(options: Any) -> dict[str, Any] | None:
    """``pg_options`` as a plain dict of the fields set on it (``None`` stays ``None``)."""
    if options is None:
        return None
    if not isinstance(options, _StandInOptions):
        return {"unexpected": type(options).__name__}
    out: dict[str, Any] = {"is_high_priority_stream": options.is_high_priority_stream}
    for name in CONFIG_FIELDS:
        if hasattr(options.config, name):
            out[name] = getattr(options.config, name)
    return out


class CreationRecorder:
    """Replaces ``new_group`` and ``split_group``: records the rank's groups, then makes them.

    Only calls whose group holds this rank are recorded (MCore asks ``new_group`` for every
    group of the world). The group is made by the real ``new_group`` on the fake backend,
    members only, without the stand-in options (the fake backend takes none) and on the
    default backend (a gloo group would need real peers).
    """

    def __init__(self, real_new_group: Any) -> None:
        self.real_new_group = real_new_group
        self.records: list[dict[str, Any]] = []
        self._seen: dict[int, int] = {}  # id(pg_options) -> index of the first record that used it
        self._keep: list[Any] = []  # keep options alive so that ids stay unique

    def take(self) -> list[dict[str, Any]]:
        out, self.records, self._seen, self._keep = self.records, [], {}, []
        return out

    def _note(self, members, desc, timeout, backend, pg_options, via) -> Any:
        import torch.distributed as dist

        shared = None
        if pg_options is not None:
            shared = self._seen.setdefault(id(pg_options), len(self.records))
            shared = None if shared == len(self.records) else shared
            self._keep.append(pg_options)
        self.records.append(
            {
                "ranks": list(members),
                "desc": desc,
                "timeout": None if timeout is None else timeout.total_seconds(),
                "backend": None if backend is None else str(backend),
                "options": options_dict(pg_options),
                "via": via,
                "reuses_options_of": shared,
            }
        )
        kw = {} if timeout is None else {"timeout": timeout}
        group = self.real_new_group(members, use_local_synchronization=True, group_desc=desc, **kw)
        assert group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER
        return group

    def new_group(
        self,
        ranks=None,
        timeout=None,
        backend=None,
        pg_options=None,
        use_local_synchronization=False,
        group_desc=None,
        device_id=None,
    ):
        import torch.distributed as dist

        members = sorted(range(dist.get_world_size()) if ranks is None else ranks)
        if dist.get_rank() not in members:
            return dist.GroupMember.NON_GROUP_MEMBER
        return self._note(members, group_desc, timeout, backend, pg_options, "new_group")

    def split_group(self, parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, **kw):
        import torch.distributed as dist

        rank = dist.get_rank()
        mine = next((sorted(g) for g in split_ranks or () if rank in g), None)
        if mine is None:
            return None
        return self._note(mine, group_desc, timeout, kw.get("backend"), pg_options, "split_group")


# (name, world, kwargs, kwargs the release must have): sizes and options MCore reads
CONFIGS: list[tuple[str, int, dict[str, Any], tuple[str, ...]]] = [
    (
        "tp2-pp2-cp2",
        16,
        {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 2},
        (),
    ),
    (
        "tp2-pp2-ep2-etp1",
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
        },
        (),
    ),
    (
        "tp2-ep2-dist-opt2",
        16,
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "num_distributed_optimizer_instances": 2},
        (),
    ),
    (
        "tp2-hcp2x2",
        16,
        {"tensor_model_parallel_size": 2, "context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]},
        (),
    ),
    (
        "tp2-cp2-hybrid",
        16,
        {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "hybrid_context_parallel": True},
        ("hybrid_context_parallel",),
    ),
]
RANKS = (0, 6, 15)
#: Groups given high-priority streams (releases with ``high_priority_stream_groups``); as the
#: config's shapes rotate per configuration, each is configured in some and unnamed in others.
HIGH_PRIORITY = ["dp_cp", "ep_dp", "tp_cp"]


def nccl_config(keys: list[str], shift: int = 0) -> dict[str, dict[str, Any]]:
    """A communicator config naming ``keys`` with different options each.

    Five shapes in turn (``shift`` rotates them): every field (and a high-priority stream),
    ``cga_cluster_size`` only, ``net_name`` and ``min_ctas`` (with the ``max_ctas`` NCCL needs
    next to it), no field (``{}``), not named.
    """
    cfgs: dict[str, dict[str, Any]] = {}
    for i, key in enumerate(sorted(keys)):
        shape = (i + shift) % 5
        if shape == 4:
            continue  # not named: no options
        if shape == 0:
            cfgs[key] = {
                "cga_cluster_size": i + 1,
                "max_ctas": 8 + i,
                "min_ctas": 2,
                "net_name": "IB",
                "is_high_priority_stream": True,
            }
        elif shape == 1:
            cfgs[key] = {"cga_cluster_size": i + 1}
        elif shape == 2:
            cfgs[key] = {"net_name": "socket", "min_ctas": i + 1, "max_ctas": 32}
        else:
            cfgs[key] = {}
    return cfgs


def _release_keys(source: str) -> list[str]:
    """The group names the release's ``get_nccl_options`` calls name (its config keys)."""
    import re

    return sorted(set(re.findall(r"get_nccl_options\(\s*[\"']([a-z_]+)[\"']", source)))


def compare(mcore: list[dict], ours: list[dict]) -> list[str]:
    """Per group (members and desc), MCore's recorded creation against ours; the differences."""
    fields = ("timeout", "backend", "options")

    def by_group(records: list[dict]) -> dict[tuple, list[str]]:
        out: dict[tuple, list[str]] = defaultdict(list)
        for r in records:
            out[(tuple(r["ranks"]), r["desc"])].append(json.dumps({f: r[f] for f in fields}, sort_keys=True))
        return {k: sorted(v) for k, v in out.items()}

    ref, got = by_group(mcore), by_group(ours)
    problems = []
    for key in sorted(set(ref) | set(got), key=str):
        if ref.get(key) != got.get(key):
            problems.append(f"group {list(key[0])} {key[1]!r}: MCore {ref.get(key)} != compat {got.get(key)}")
    return problems


def _init(module: Any, kwargs: dict, cfgs: dict) -> None:
    """``initialize_model_parallel``, then (0.18+) ``create_all_gather_groups`` with its own timeout."""
    module.initialize_model_parallel(**kwargs)
    if hasattr(module, "create_all_gather_groups"):
        module.create_all_gather_groups(for_expert_parallelism=True, timeout=timedelta(minutes=3), nccl_comm_cfgs=cfgs)


def _play(mps: Any, ps: Any, recorder: CreationRecorder, kwargs: dict, cfgs: dict, rank: int, world: int) -> dict:
    """One rank: MCore's recorded creations, then compat's on the member and the split path."""
    from parallel_state_ng.groups.sharing import set_group_sharing
    from parallel_state_ng.groups.split import ENV_CREATION_PATH
    from parallel_state_ng.testing.worlds import init_simulated_rank
    from tests.support.differential import library as D

    init_simulated_rank(rank, world, replace=True)
    D.reset_mcore()
    try:
        _init(mps, kwargs, cfgs)
    finally:
        mps.destroy_model_parallel()
        D.reset_mcore()
    out = {"mcore": recorder.take()}
    saved = os.environ.get(ENV_CREATION_PATH)
    # every group made, as MCore makes it: no sharing (unset, the split path would share under safe)
    previous_sharing = set_group_sharing("off")
    try:
        for side in ("member", "split"):
            os.environ[ENV_CREATION_PATH] = side
            try:
                _init(ps, kwargs, cfgs)
            finally:
                ps.destroy_model_parallel()
            out[side] = recorder.take()
    finally:
        set_group_sharing(previous_sharing)
        if saved is None:
            os.environ.pop(ENV_CREATION_PATH, None)
        else:
            os.environ[ENV_CREATION_PATH] = saved
    return out


def run(configs: list[str] | None = None, ranks: list[int] | None = None) -> dict[str, Any]:
    """Record MCore's and compat's creations per configuration and rank; compare them.

    Returns ``{"configs", "keys", "helper_calls", "compared", "mismatches", "option_reuse",
    "problems"}``: ``compared`` counts MCore's groups of the played ranks (per path; 0.18+ with
    ``create_all_gather_groups``), ``helper_calls`` the ``get_nccl_options`` calls compared (every
    key, per configuration), ``option_reuse`` the creations handed an options object an earlier
    creation of the same init got (per side: MCore shares one across hierarchical levels).
    """
    import megatron.core.parallel_state as mps
    import torch.distributed as dist
    import yaml

    import compat.parallel_state as ps

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    params = set(inspect.signature(mps.initialize_model_parallel).parameters)
    keys = _release_keys(inspect.getsource(mps))
    real = {name: getattr(dist, name, None) for name in ("new_group", "split_group", "ProcessGroupNCCL")}
    recorder = CreationRecorder(dist.new_group)
    problems: list[str] = []
    compared = {"member": 0, "split": 0}
    mismatches = {"member": 0, "split": 0}
    reuse = {"mcore": 0, "member": 0, "split": 0}
    played = []
    helpers = 0
    dist.new_group, dist.split_group = recorder.new_group, recorder.split_group
    dist.ProcessGroupNCCL = StandInNCCL
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for index, (name, world, sizes, needs) in enumerate(CONFIGS):
                if (configs and name not in configs) or not set(needs) <= params:
                    continue
                played.append(name)
                path = os.path.join(tmp, f"{name}.yaml")
                cfgs = nccl_config(keys, shift=index)
                with open(path, "w") as f:
                    yaml.safe_dump(cfgs, f)
                helpers += len(keys)
                for key in keys:
                    want, got = (options_dict(m.get_nccl_options(key, cfgs)) for m in (mps, ps))
                    if want != got:
                        problems.append(f"{name}: get_nccl_options({key!r}): MCore {want} != compat {got}")
                kwargs: dict[str, Any] = {**sizes, "nccl_communicator_config_path": path}
                kwargs["distributed_timeout_minutes"] = 7 + index
                if "create_gloo_process_groups" in params:
                    kwargs["create_gloo_process_groups"] = False
                if "high_priority_stream_groups" in params:
                    kwargs["high_priority_stream_groups"] = list(HIGH_PRIORITY)
                for rank in ranks or RANKS:
                    runs = _play(mps, ps, recorder, kwargs, cfgs, rank, world)
                    for side, records in runs.items():
                        reuse[side] += sum(r["reuses_options_of"] is not None for r in records)
                    if not any(r["via"] == "split_group" for r in runs["split"]):
                        problems.append(f"{name} rank {rank}: the split path made no split")
                    for side in ("member", "split"):
                        found = compare(runs["mcore"], runs[side])
                        compared[side] += len(runs["mcore"])
                        mismatches[side] += len(found)
                        problems += [f"{name} rank {rank} {side}: {p}" for p in found]
    finally:
        for attr, value in real.items():
            if value is None:
                if hasattr(dist, attr):
                    delattr(dist, attr)
            else:
                setattr(dist, attr, value)
        if dist.is_initialized():
            dist.destroy_process_group()
    return {
        "configs": played,
        "keys": len(keys),
        "helper_calls": helpers,
        "compared": compared,
        "mismatches": mismatches,
        "option_reuse": reuse,
        "problems": problems,
    }
