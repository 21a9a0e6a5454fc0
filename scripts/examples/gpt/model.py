"""The tiny GPT of the CPU training example: data, model config, weights, optimizer settings, steps.

What every way of training it shares (Megatron's globals in :mod:`scripts.examples.gpt.training`,
a ``ProcessGroupCollection`` in :mod:`scripts.examples.gpt.collection`, the restart of
:mod:`scripts.examples.restart_gpt`); none of it reads a parallel_state global except
:func:`set_weights_from_global_names` without ``ranks``. The data: :func:`_batch`. See
scripts/README.md and docs/results/training.md.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scripts.examples.gpt.config import TrainConfig

if TYPE_CHECKING:
    from parallel_state_ng.groups.sleep import SleepReport


def _batch(cfg: TrainConfig, step: int, global_mb: int) -> dict[str, torch.Tensor]:
    """The deterministic microbatch ``global_mb`` of ``step``.

    Every sample is a token sequence ``(start + stride * i) % vocab`` with ``start`` and ``stride``
    drawn from a generator seeded by (seed, step, global microbatch, sample); the global microbatch
    index is ``dp_rank * microbatches + microbatch``, so layouts with the same global batch see the
    same samples.
    """
    rows = []
    for j in range(cfg.micro_batch):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 10_007 + global_mb * 101 + j)
        start = int(torch.randint(cfg.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        rows.append((start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab)
    seqs = torch.stack(rows)
    return {
        "tokens": seqs[:, :-1].contiguous(),
        "labels": seqs[:, 1:].contiguous(),
        "loss_mask": torch.ones(cfg.micro_batch, cfg.seq),
        "position_ids": torch.arange(cfg.seq).expand(cfg.micro_batch, cfg.seq).contiguous(),
    }


def _microbatches(
    cfg: TrainConfig, step: int, dp_rank: int, device: str | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    for mb in range(cfg.microbatches):
        batch = _batch(cfg, step, dp_rank * cfg.microbatches + mb)
        yield batch if device is None else {name: t.to(device) for name, t in batch.items()}


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def transformer_config(cfg: TrainConfig):
    """Megatron's ``TransformerConfig`` of ``cfg``: float32, CPU initialization, every fusion off."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if cfg.experts:
        moe = dict(
            num_moe_experts=cfg.experts,
            expert_model_parallel_size=cfg.ep,
            moe_router_topk=cfg.topk,
            moe_token_dispatcher_type=cfg.dispatcher,
            moe_aux_loss_coeff=0.01,
        )
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        hidden_dropout=cfg.dropout,
        attention_dropout=cfg.dropout,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # batched p2p with the interleaved schedule at pp 2 pairs sends wrongly in MCore itself
        batch_p2p_comm=cfg.vpp is None,
        add_bias_linear=cfg.bias,
        **moe,
    )


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def global_param_name(chunk, name: str, *, num_local_experts: int = 0, ep_rank: int = 0) -> str:
    """The name a local parameter of ``chunk`` (a ``GPTModel``) has in the unsplit model:
    layer indices made global (pipeline stage / virtual chunk offset), local expert indices
    made global (expert-parallel rank offset), and the output layer of a tied model named as
    the word embedding it shares.
    """
    match = _LAYER.match(name)
    if match:
        layer = chunk.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end() :]
    expert = _EXPERT.search(name)
    if expert:
        index = ep_rank * num_local_experts + int(expert.group(1))
        name = name[: expert.start()] + f".local_experts.{index}." + name[expert.end() :]
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight"
    return name


def _global_value(name: str, shape: list[int], seed: int) -> torch.Tensor:
    """A deterministic full tensor for the global parameter ``name``."""
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=g)
    if name.endswith("layer_norm_weight") or ("norm" in name and name.endswith(".weight")):
        return 1.0 + 0.1 * noise
    if name.endswith("bias"):
        return 0.01 * noise
    return 0.05 * noise


def set_weights_from_global_names(cfg: TrainConfig, chunks: list, ranks: tuple[int, int, int] | None = None) -> int:
    """Overwrite every parameter with its slice of a tensor derived from its global name only,
    so that any layout holds the same global model. Returns the number of parameters set.

    ``ranks`` is (tensor-parallel rank, tensor-parallel size, expert-parallel rank); ``None``:
    read from ``parallel_state``.
    """
    if ranks is None:
        from megatron.core import parallel_state as ps

        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        ep_rank = ps.get_expert_model_parallel_rank() if cfg.experts else 0
    else:
        tp_rank, tp, ep_rank = ranks
        ep_rank = ep_rank if cfg.experts else 0
    local_experts = (cfg.experts or 0) // cfg.ep
    count = 0
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                gname = global_param_name(chunk, name, num_local_experts=local_experts, ep_rank=ep_rank)
                shape = list(param.shape)
                split = getattr(param, "tensor_model_parallel", False) and tp > 1
                if split:
                    dim = param.partition_dim
                    shape[dim] *= tp
                full = _global_value(gname, shape, cfg.seed)
                param.copy_(full.chunk(tp, dim)[tp_rank] if split else full)
                count += 1
    return count


def digest(chunks: list) -> str:
    """SHA-256 over this rank's parameters (chunk, name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    for i, chunk in enumerate(chunks):
        for name, param in sorted(chunk.named_parameters()):
            t = param.detach().contiguous().cpu()
            h.update(f"{i}:{name}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def ddp_config(cfg: TrainConfig):
    """Megatron's DDP settings for the CPU runs (optionally overlapped, optionally the distributed optimizer)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=cfg.overlap,
        overlap_param_gather=cfg.overlap and cfg.dist_opt,
        use_distributed_optimizer=cfg.dist_opt,
    )


def optimizer_config(cfg: TrainConfig):
    """Adam with gradient clipping (optionally the distributed optimizer), the same for every path."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.dist_opt,
        params_dtype=torch.float32,
    )


def train_steps(
    cfg: TrainConfig,
    model: list,
    optimizer,
    forward_backward,
    last_stage: bool,
    dp_group,
    reporter: bool,
    first_step: int = 0,
    device: str | None = None,
) -> tuple[list[float], list[float]]:
    """``cfg.steps`` optimizer steps with the schedule ``forward_backward``; (losses, grad norms).

    Losses exist on the last pipeline stage only (mean over microbatches and the data-parallel
    group ``dp_group``); ``reporter`` prints each step. ``first_step`` is the index of the first
    step's data (a run resumed after ``first_step`` steps sees the data it would have seen).
    ``device`` (e.g. ``"cuda"``): where the microbatches go (``None``: they stay on the CPU).
    """
    dp_rank = dist.get_rank(dp_group)
    losses, grad_norms = [], []
    for step in range(first_step, first_step + cfg.steps):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        iters = [_microbatches(cfg, step, dp_rank, device) for _ in model]
        store = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=model,
            num_microbatches=cfg.microbatches,
            seq_length=cfg.seq,
            micro_batch_size=cfg.micro_batch,
            forward_only=False,
        )
        updated, grad_norm, _ = optimizer.step()
        if not updated:
            raise RuntimeError(f"optimizer step {step + 1} was skipped")
        grad_norms.append(float(grad_norm))
        if last_stage:
            loss = torch.stack([d["lm loss"] for d in store]).mean().view(1)
            dist.all_reduce(loss, group=dp_group)
            losses.append(float(loss / dist.get_world_size(dp_group)))
            if cfg.verbose and reporter:
                print(f"step {step + 1}: loss {losses[-1]:.6f}  grad norm {grad_norms[-1]:.6f}", flush=True)
        if cfg.sleep_wake:
            sleep_and_wake()
    return losses, grad_norms


def sleep_and_wake() -> SleepReport:
    """Every communicator asleep, a collective refused, then awake: an RL job's interlude.

    Every rank calls it together (compat's groups); returns this rank's sleep report.
    """
    import compat.parallel_state as ps
    from parallel_state_ng.groups.sleep import GroupAsleepError

    report = ps.sleep_model_parallel(timeout=120)
    try:
        dist.all_reduce(torch.ones(1), group=ps.get_data_parallel_group())
    except GroupAsleepError:
        pass
    else:
        raise RuntimeError(f"a collective on a sleeping group was not refused: {report}")
    finally:
        ps.wake_model_parallel(timeout=120)
    return report
