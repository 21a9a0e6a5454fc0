"""GPU memory held by the groups: MCore against compat's sharing settings.

:func:`rank_memory` runs on every rank of the one-GPU NCCL world (all ranks on one device, so
the device's free memory counts every rank's communicators): free memory before the init,
after one all-reduce on every group (each communicator connected), and after destroy. Cases:
MCore; compat with ``PSNG_SHARE_GROUPS`` ``0``, ``1`` and ``process``; compat on the split path
(NCCL's split sharing needs its variable before ``init_process_group``: ``scripts/gpu/split_share.py``).
GPU only (``--launcher gpu``, the hook in
:mod:`scripts.bench.phases`); nothing of it has run yet. docs/gpus.md ("GPU memory").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from scripts.bench.init_phases import _first_use, parse_layout
from scripts.bench.phases import LAUNCHERS

#: name -> (impl, PSNG_SHARE_GROUPS, PSNG_CREATION_PATH)
CASES = {
    "mcore": ("mcore", "0", "auto"),
    "compat share 0": ("compat", "0", "auto"),
    "compat share 1": ("compat", "1", "auto"),
    "compat share process": ("compat", "process", "auto"),
    "compat split": ("compat", "0", "split"),
}
MIB = 2**20


def rank_memory(case: str, layout: str, gloo: bool = False) -> dict[str, Any]:
    """On every rank: the device's free MiB before init, with every group used once, after destroy."""
    import torch
    import torch.distributed as dist

    impl, share, path = CASES[case]
    env = {"PSNG_SHARE_GROUPS": share, "PSNG_CREATION_PATH": path}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if impl == "mcore":
        from megatron.core import parallel_state as mod
    else:
        import compat.parallel_state as mod

    def free() -> float:
        torch.cuda.synchronize()
        dist.barrier()
        return torch.cuda.mem_get_info()[0] / MIB

    world = dist.distributed_c10d._world
    try:
        before = set(world.pg_map)
        start = free()
        mod.initialize_model_parallel(**parse_layout(layout), create_gloo_process_groups=gloo)
        _, used, bad = _first_use(mod)
        groups = len([pg for pg in world.pg_map if pg not in before])
        in_use = free()
        mod.destroy_model_parallel()
        for pg in [pg for pg in world.pg_map if pg not in before]:  # MCore leaves its groups
            dist.destroy_process_group(pg)
        after = free()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {
        "case": case,
        "free_before_mib": start,
        "free_in_use_mib": in_use,
        "free_after_mib": after,
        "held_mib": start - in_use,
        "groups": groups,
        "used": used,
        "bad": bad,
    }


def main(argv: list[str] | None = None) -> int:
    """Run every case on the GPU world; print one line per case (rank 0's view of the device)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default="gpu")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--layout", default="tp2-pp2")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = []
    print(f"{'case':<28} {'held MiB':>9} {'before':>9} {'in use':>9} {'after':>9} {'groups':>6} {'bad':>4}")
    for case in a.cases.split(","):
        r = LAUNCHERS[a.launcher](a.world, rank_memory, (case, a.layout), 480.0)[0]
        rows.append(r)
        print(
            f"{case:<28} {r['held_mib']:9.0f} {r['free_before_mib']:9.0f} {r['free_in_use_mib']:9.0f} "
            f"{r['free_after_mib']:9.0f} {r['groups']:6d} {len(r['bad']):4d}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
