"""One rank of the tiny GPT run on Megatron's new-code path: a ProcessGroupCollection, no globals.

The same model, data, optimizer and schedule as :mod:`scripts.examples.gpt.training`, but the groups
come from :func:`parallel_state_ng.build_megatron_groups` and reach Megatron as ``pg_collection=``.
What the path still needs from outside the collection: :data:`GLOBAL_SETUP` (provided by the
engine's ``ensure_global_memory_buffer`` and ``megatron_schedule``). With ``--impl mcore`` it
needs megatron-core 0.19+ (:data:`FIRST_RELEASE`); with ``--impl compat`` (0.16+,
:data:`FIRST_SERVED_RELEASE`) the run sits inside ``compat.use_collection(collection)``, so the
global getters that 0.16-0.18 still call (the GPT loss reads the tensor-parallel group) answer
from the same collection. See docs/results/training.md (training from a ``ProcessGroupCollection``).
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from scripts.examples.gpt.config import TrainConfig
from scripts.examples.gpt.model import (
    ddp_config,
    digest,
    optimizer_config,
    set_weights_from_global_names,
    train_steps,
    transformer_config,
)

#: What the collection path still takes from Megatron's globals, and how it is given here.
GLOBAL_SETUP = {
    "global memory buffer": "ensure_global_memory_buffer() (DotProductAttention reads it)",
    "schedule": "megatron_schedule(groups, config): get_forward_backward_func(pp_size=, vp_size=)",
    "pipeline p2p": "megatron_schedule passes P2PCommunicator(pp_group=collection.pp, config=...)",
    "optimizer": "use_gloo_process_groups=False (Megatron refuses gloo groups next to a collection)",
}
#: First megatron-core series whose GPT training reads no global group on the collection path
#: (0.16-0.18: vocab_parallel_cross_entropy calls get_tensor_model_parallel_group()).
FIRST_RELEASE = "0.19"
#: First series whose GPT path takes ``pg_collection=`` everywhere the run needs it; before 0.19
#: the few global reads left are served from the collection by ``compat.use_collection``.
FIRST_SERVED_RELEASE = "0.16"


def _build_model(cfg: TrainConfig, tcfg, pgc) -> list:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=cfg.experts)
    pp_rank, pp_size, chunks_per_rank = pgc.pp.rank(), pgc.pp.size(), cfg.vpp or 1
    chunks = []
    for i in range(chunks_per_rank):
        chunks.append(
            GPTModel(
                config=tcfg,
                transformer_layer_spec=spec,
                vocab_size=cfg.vocab,
                max_sequence_length=cfg.seq,
                pre_process=pp_rank == 0 and i == 0,
                post_process=pp_rank == pp_size - 1 and i == chunks_per_rank - 1,
                share_embeddings_and_output_weights=True,
                position_embedding_type="learned_absolute",
                vp_stage=i if cfg.vpp else None,
                pg_collection=pgc,
            )
        )
    return chunks


def require_collection_release(served: bool = False) -> None:
    """Raise ``RuntimeError`` when the loaded megatron-core is older than :data:`FIRST_RELEASE`
    (``served``: the collection is also served as compat's globals, :data:`FIRST_SERVED_RELEASE`).
    """
    from parallel_state_ng.releases import current_release

    release = current_release()
    if served and release.before(FIRST_SERVED_RELEASE):
        raise RuntimeError(
            f"--groups collection --impl compat needs megatron-core {FIRST_SERVED_RELEASE}+ (got {release.version})"
        )
    if not served and release.before(FIRST_RELEASE):
        raise RuntimeError(
            f"--groups collection needs megatron-core {FIRST_RELEASE}+ (got {release.version}): before it the "
            f"GPT loss (vocab_parallel_cross_entropy) reads the global tensor-parallel group"
        )


def collection_training(cfg: TrainConfig, pgc) -> tuple[list, list, Any, Any]:
    """``(chunks, model, optimizer, forward_backward)`` of ``cfg`` over the collection ``pgc``.

    Seeds as the global path does, one ``GPTModel`` per virtual chunk, Megatron's DDP with
    ``finalize_model_grads``, ``get_megatron_optimizer`` and the schedule, each given ``pgc``.
    Needs Megatron's global memory buffer (:func:`~parallel_state_ng.ensure_global_memory_buffer`).
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parallel_state_ng import megatron_schedule

    tp_rank, ep_rank = pgc.tp.rank(), pgc.ep.rank()
    seed = cfg.seed + 100 * pgc.pp.rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=pgc.expt_tp.rank())
    tcfg = transformer_config(cfg)
    chunks = _build_model(cfg, tcfg, pgc)
    if cfg.init_from_names:
        set_weights_from_global_names(cfg, chunks, ranks=(tp_rank, pgc.tp.size(), ep_rank))
    ddp_cfg = ddp_config(cfg)
    model = [
        DistributedDataParallel(tcfg, ddp_cfg, chunk, disable_bucketing=i > 0, pg_collection=pgc)
        for i, chunk in enumerate(chunks)
    ]
    tcfg.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    tcfg.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pgc)
    optimizer = get_megatron_optimizer(
        optimizer_config(cfg),
        model,
        use_gloo_process_groups=False,
        pg_collection=pgc,
    )
    forward_backward = megatron_schedule(pgc, tcfg)  # pg_collection= and p2p_communicator= included
    return chunks, model, optimizer, forward_backward


def train_collection(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg`` on this rank from a collection (see the module doc); the result of ``train_rank``."""
    from megatron.core import parallel_state as ps

    import compat
    from parallel_state_ng import build_megatron_groups, ensure_global_memory_buffer

    served = compat.is_installed()  # --impl compat: the collection is also compat's globals
    require_collection_release(served)
    if ps.model_parallel_is_initialized():
        raise RuntimeError("the collection path must run with Megatron's globals uninitialized")
    groups = build_megatron_groups(
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp, expert_model_parallel_size=cfg.ep
    )
    t0 = time.perf_counter()
    ensure_global_memory_buffer()
    try:
        pgc = groups.collection()
        with compat.use_collection(pgc) if served else contextlib.nullcontext():
            chunks, model, optimizer, forward_backward = collection_training(cfg, pgc)
            t1 = time.perf_counter()
            tp_rank, pp_rank = pgc.tp.rank(), pgc.pp.rank()
            last_stage = pp_rank == cfg.pp - 1
            dp_group = pgc.dp
            reporter = last_stage and tp_rank == 0 and pgc.dp.rank() == 0
            losses, grad_norms = train_steps(cfg, model, optimizer, forward_backward, last_stage, dp_group, reporter)
        return {
            "rank": dist.get_rank(),
            "losses": losses if last_stage else None,
            "grad_norms": grad_norms,
            "digest": digest(chunks),
            "params": sum(p.numel() for c in chunks for p in c.parameters()),
            "facts": {
                "groups": "collection",
                "served as globals": str(served),
                "globals initialized": str(ps.model_parallel_is_initialized()),
            },
            "seconds": {"setup": round(t1 - t0, 3), "steps": round(time.perf_counter() - t1, 3)},
        }
    finally:
        ps.destroy_global_memory_buffer()
        groups.destroy()
