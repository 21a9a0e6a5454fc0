"""A ``pretrain_gpt.py`` for CPU processes started by a launcher: Megatron-LM's ``pretrain``, nothing about compat.

What Megatron-LM's ``pretrain_gpt.py`` is to a GPU job, this script is to a CPU one: started by
``torchrun`` (or ``srun`` with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``
set), it calls ``megatron.training.pretrain`` with the providers of
:mod:`scripts.examples.gpt.pretrain`, which reads its command line with Megatron's own parser
(after :data:`~scripts.examples.gpt.pretrain.CPU_DEFAULTS` and
:data:`~scripts.examples.gpt.pretrain.TINY_MODEL`) and joins the launcher's world (env://). The
only additions are the CPU stand-ins for CUDA (:mod:`parallel_state_ng.testing.megatron_cpu`).
It never imports compat: ``python -m compat.run`` in front of it is what switches it over::

    torchrun --nproc-per-node 4 scripts/examples/gpt/pretrain_gpt.py --tensor-model-parallel-size 2
    torchrun --nproc-per-node 4 -m compat.run scripts/examples/gpt/pretrain_gpt.py ...  # the same job on compat

The megatron-core used is the one Python finds (``PYTHONPATH=DIR`` for an unzipped wheel). The
last rank prints each iteration's loss and gradient norm in full precision, the digest of every
rank's final parameters and which ``parallel_state`` Megatron used; with
``$PSNG_PRETRAIN_RECORD=DIR`` every rank also writes its record to ``DIR/rank-R.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# run as a file (as launchers run pretrain_gpt.py): the repository root makes ``scripts`` importable
_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)

RECORD_ENV = "PSNG_PRETRAIN_RECORD"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _groups_in(value: object, kind: type) -> list:
    """Process groups held by ``value``: itself, or the members of a list, tuple, dict or ``ProcessGroupCollection``."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    elif type(value).__name__ == "ProcessGroupCollection":
        value = list(vars(value).values())
    if isinstance(value, (list, tuple)):
        return [g for item in value if isinstance(item, kind) for g in [item]]
    return []


def group_facts(parallel_state: object, chunks: list) -> dict:
    """Where the model's process groups came from.

    ``served``: the groups held by the globals of the ``parallel_state`` module Megatron used;
    ``model``: the groups the model chunks hold (module attributes and ``pg_collection`` fields);
    ``not_served``: how many of those are not among ``served``; ``megatron_module_run``: whether
    Megatron's own ``megatron/core/parallel_state.py`` was executed in this process.
    """
    from torch.distributed import ProcessGroup

    served = {id(g) for value in vars(parallel_state).values() for g in _groups_in(value, ProcessGroup)}
    model = {}
    for chunk in chunks:
        for module in chunk.modules():
            for value in vars(module).values():
                for group in _groups_in(value, ProcessGroup):
                    model[id(group)] = group
    suffix = os.path.join("megatron", "core", "parallel_state.py")
    own = [m for m in list(sys.modules.values()) if str(getattr(m, "__file__", "") or "").endswith(suffix)]
    return {
        "served": len(served),
        "model": len(model),
        "not_served": sum(1 for key in model if key not in served),
        "megatron_module_run": bool(own),
    }


def main() -> int:
    """Run ``pretrain`` as this process's rank of the launcher's world; 2 without a launcher."""
    missing = [name for name in _LAUNCHER_VARS if name not in os.environ]
    if missing:
        print(
            f"error: {', '.join(missing)} not set: start this script with a launcher "
            "(torchrun --nproc-per-node N scripts/examples/gpt/pretrain_gpt.py ...)",
            file=sys.stderr,
        )
        return 2
    import torch
    import torch.distributed as dist

    from parallel_state_ng.groups.objects import all_gather_objects
    from parallel_state_ng.testing.megatron_cpu import CpuShims, TrainingShims
    from scripts.examples.gpt import pretrain as lm

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # what a GPU job sets for tp > 1
    torch.set_num_threads(1)
    sys.argv = [sys.argv[0], *lm.CPU_DEFAULTS, *lm.TINY_MODEL, *sys.argv[1:]]
    recorder = lm._LogRecorder()
    with CpuShims() as shims, TrainingShims() as training_shims:
        shims.patch_megatron()
        training_shims.patch_megatron()
        from megatron.core import parallel_state as ps
        from megatron.core.enums import ModelType
        from megatron.training import pretrain

        with shims.cuda_to_cpu(), recorder.installed():
            lm._call_pretrain(pretrain, ModelType.encoder_or_decoder, None)
        record = {
            "rank": rank,
            "world_size": world_size,
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
            "iterations": recorder.iterations,
            "digest": lm._digest(lm._BUILT),
            "parallel_state": ps.__name__,
            "training.mpu": lm._training_mpu(),
            "version": lm._version(),
            "groups": group_facts(ps, lm._BUILT),
        }
        ps.destroy_model_parallel()
    records = all_gather_objects(record)
    dist.destroy_process_group()
    directory = os.environ.get(RECORD_ENV)
    if directory:
        with open(os.path.join(directory, f"rank-{rank}.json"), "w", encoding="utf-8") as out:
            json.dump(record, out)
    if rank == world_size - 1:
        _print_summary(records)
    return 0


def _print_summary(records: list[dict]) -> None:
    import hashlib

    last = next(r for r in records if r["last_stage"])
    for it in last["iterations"]:
        losses = "  ".join(f"{k} {v!r}" for k, v in it["losses"].items())
        print(f"iteration {it['iteration']}: {losses}  grad norm {it['grad_norm']!r}")
    groups = [r["groups"] for r in records]
    print(
        f"megatron-core {last['version']}; parallel_state used: {last['parallel_state']}; world of "
        f"{len(records)}; groups the model holds: {sum(g['model'] for g in groups)}, not from that module: "
        f"{sum(g['not_served'] for g in groups)}"
    )
    print(f"parameter digest: {hashlib.sha256(''.join(r['digest'] for r in records).encode()).hexdigest()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
