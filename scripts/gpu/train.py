"""The GPU check's training part: the tiny GPT of ``train_gpt`` on one device, MCore then compat.

:func:`train_both` trains the same steps under MCore's own parallel_state and under compat
(``compat.install()`` after megatron is imported) in this process, on CUDA or, for the dry run,
on the CPU with :class:`~parallel_state_ng.testing.megatron_cpu.CpuShims`; losses, gradient norms
and a parameter digest must be bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from parallel_state_ng.testing.megatron_cpu import CpuShims
from scripts.examples.gpt.config import TrainConfig
from scripts.examples.gpt.model import (
    digest,
    train_steps,
)
from scripts.examples.gpt.training import parallel_state_impl, seeded_model_and_optimizer

#: The model trained: train_gpt's tiny GPT, one process (tp 1, pp 1, dp 1), weights from names.
CONFIG = TrainConfig(steps=3, num_layers=2, init_from_names=True)


@contextlib.contextmanager
def _on_device(device: str) -> Iterator[None]:
    """Megatron on ``device``: CUDA as it is, or the CPU through the CPU stand-ins."""
    if device != "cpu":
        yield
        return
    with CpuShims() as shims:
        shims.patch_megatron()
        with shims.cuda_to_cpu():
            yield


def _train(cfg: TrainConfig, device: str) -> dict[str, Any]:
    """``cfg.steps`` steps through Megatron's globals (whichever parallel_state megatron uses)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        chunks, model, optimizer = seeded_model_and_optimizer(cfg, cfg.seed, device)
        losses, grad_norms = train_steps(
            cfg,
            model,
            optimizer,
            get_forward_backward_func(),
            True,
            ps.get_data_parallel_group(),
            False,
            device=None if device == "cpu" else device,
        )
        return {
            "losses": losses,
            "grad_norms": grad_norms,
            "digest": digest(chunks),
            "param_device": str(next(chunks[0].parameters()).device),
            "parallel_state": ps.__name__,
            "schedules_parallel_state": schedules.parallel_state.__name__,
        }
    finally:
        ps.destroy_model_parallel()


def train_once(impl: str, device: str, cfg: TrainConfig = CONFIG) -> dict[str, Any]:
    """Train ``cfg`` under ``impl`` (``mcore`` or ``compat``); the result with ``leaked_groups``
    (groups left after ``destroy_model_parallel``; destroyed here so the next run starts clean).
    """
    before = set(dist.distributed_c10d._world.pg_map)
    with parallel_state_impl(impl, "after"), _on_device(device):
        result = _train(cfg, device)
    leaked = set(dist.distributed_c10d._world.pg_map) - before
    for group in leaked:
        dist.destroy_process_group(group)
    result["leaked_groups"] = len(leaked)
    return result


def train_both(device: str, cfg: TrainConfig = CONFIG) -> dict[str, Any]:
    """MCore's run, then compat's, in this process; ``identical``: losses, gradient norms and
    digest equal bit for bit; ``compat_resolved``: megatron's code used compat in compat's run.
    """
    mcore = train_once("mcore", device, cfg)
    ours = train_once("compat", device, cfg)
    fields = ("losses", "grad_norms", "digest")
    return {
        "mcore": mcore,
        "compat": ours,
        "identical": all(mcore[f] == ours[f] for f in fields),
        "compat_resolved": ours["parallel_state"] == ours["schedules_parallel_state"] == "compat.parallel_state",
        "steps": cfg.steps,
    }
