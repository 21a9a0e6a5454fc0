"""One rank of a tiny Megatron-Core GPT training run on CPU (gloo), under MCore or compat.

:func:`train_rank` runs in every process of an initialized gloo world (``torch.distributed``
default group of ``cfg.world_size`` ranks) and does what a Megatron training loop does:
``initialize_model_parallel``, ``model_parallel_cuda_manual_seed``, a ``GPTModel`` with the
local (non-TransformerEngine) layer spec per virtual pipeline chunk, Megatron's
``DistributedDataParallel`` with ``finalize_model_grads``, ``get_megatron_optimizer`` (Adam,
gradient clipping, optionally the distributed optimizer) and ``get_forward_backward_func()``
(no pipelining, 1F1B or interleaved 1F1B). With ``cfg.impl == "compat"`` all of it runs after
``compat.install()``. CPU stand-ins for CUDA come from :mod:`cpu_shims`.

Data: every sample is a token sequence ``(start + stride * i) % vocab`` with ``start`` and
``stride`` drawn from a generator seeded by (seed, step, global microbatch, sample); the global
microbatch index is ``dp_rank * microbatches + microbatch``, so layouts with the same global
batch see the same samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import re
import sys
import time
import zlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from cpu_shims import CpuShims
from gpt_config import TrainConfig

TARGET = "megatron.core.parallel_state"
MEGATRON_PATH_ENV = "PSNG_MEGATRON_PATH"


def _use_megatron_path(path: str | None) -> None:
    """Put an extra directory (e.g. an unzipped megatron-core wheel) first on ``sys.path``."""
    path = path or os.environ.get(MEGATRON_PATH_ENV)
    if not path:
        return
    loaded = sys.modules.get("megatron.core")
    if loaded is not None and not os.path.abspath(loaded.__file__).startswith(os.path.abspath(path)):
        raise RuntimeError(f"megatron is already imported from {loaded.__file__}, not from {path}")
    if path not in sys.path:
        sys.path.insert(0, path)


def _batch(cfg: TrainConfig, step: int, global_mb: int) -> dict[str, torch.Tensor]:
    """The deterministic microbatch ``global_mb`` of ``step`` (see the module doc)."""
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


def _microbatches(cfg: TrainConfig, step: int, dp_rank: int) -> Iterator[dict[str, torch.Tensor]]:
    for mb in range(cfg.microbatches):
        yield _batch(cfg, step, dp_rank * cfg.microbatches + mb)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _transformer_config(cfg: TrainConfig):
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
        **moe,
    )


def _build_model(cfg: TrainConfig, tcfg) -> list:
    """One ``GPTModel`` per virtual pipeline chunk, following the loaded release's API: from
    0.13 on, the stage checks and ``GPTModel`` take ``vp_stage=``; 0.12 reads the virtual
    pipeline rank that ``set_virtual_pipeline_model_parallel_rank`` sets before each chunk.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=cfg.experts)
    stage_takes_vp = "vp_stage" in inspect.signature(ps.is_pipeline_first_stage).parameters
    model_takes_vp = "vp_stage" in inspect.signature(GPTModel.__init__).parameters
    chunks = []
    for i in range(cfg.vpp or 1):
        vp_stage = i if cfg.vpp else None
        if stage_takes_vp:
            stage = {"ignore_virtual": False, "vp_stage": vp_stage}
        else:
            if cfg.vpp:
                ps.set_virtual_pipeline_model_parallel_rank(i)
            stage = {"ignore_virtual": False}
        chunks.append(
            GPTModel(
                config=tcfg,
                transformer_layer_spec=spec,
                vocab_size=cfg.vocab,
                max_sequence_length=cfg.seq,
                pre_process=ps.is_pipeline_first_stage(**stage),
                post_process=ps.is_pipeline_last_stage(**stage),
                share_embeddings_and_output_weights=True,
                position_embedding_type="learned_absolute",
                **({"vp_stage": vp_stage} if model_takes_vp else {}),
            )
        )
    if cfg.vpp and not stage_takes_vp:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


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


def _digest(chunks: list) -> str:
    """SHA-256 over this rank's parameters (chunk, name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    for i, chunk in enumerate(chunks):
        for name, param in sorted(chunk.named_parameters()):
            t = param.detach().contiguous().cpu()
            h.update(f"{i}:{name}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _facts(ps) -> dict[str, str]:
    """Which parallel_state module megatron's training code resolved to (while initialized)."""
    from megatron.core import package_info
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers

    return {
        "version": package_info.__version__,
        "megatron.core.parallel_state": ps.__name__,
        "schedules.parallel_state": schedules.parallel_state.__name__,
        "layers.get_tensor_model_parallel_rank": layers.get_tensor_model_parallel_rank.__module__,
        "initialized": str(ps.model_parallel_is_initialized()),
    }


def ddp_config(cfg: TrainConfig):
    """Megatron's DDP settings for the CPU runs (no overlap, optionally the distributed optimizer)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
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
) -> tuple[list[float], list[float]]:
    """``cfg.steps`` optimizer steps with the schedule ``forward_backward``; (losses, grad norms).

    Losses exist on the last pipeline stage only (mean over microbatches and the data-parallel
    group ``dp_group``); ``reporter`` prints each step. ``first_step`` is the index of the first
    step's data (a run resumed after ``first_step`` steps sees the data it would have seen).
    """
    dp_rank = dist.get_rank(dp_group)
    losses, grad_norms = [], []
    for step in range(first_step, first_step + cfg.steps):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        iters = [_microbatches(cfg, step, dp_rank) for _ in model]
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
    return losses, grad_norms


def _train(cfg: TrainConfig) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        expert_model_parallel_size=cfg.ep,
    )
    t0 = time.perf_counter()
    try:
        seed = cfg.seed + 100 * ps.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        tcfg = _transformer_config(cfg)
        chunks = _build_model(cfg, tcfg)
        if cfg.init_from_names:
            set_weights_from_global_names(cfg, chunks)
        ddp_cfg = ddp_config(cfg)
        model = [
            DistributedDataParallel(tcfg, ddp_cfg, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)
        ]
        tcfg.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        tcfg.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(
            optimizer_config(cfg),
            model,
        )
        forward_backward = get_forward_backward_func()
        t1 = time.perf_counter()
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        dp_group, dp_rank = ps.get_data_parallel_group(), ps.get_data_parallel_rank()
        reporter = last_stage and ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
        losses, grad_norms = train_steps(cfg, model, optimizer, forward_backward, last_stage, dp_group, reporter)
        return {
            "rank": dist.get_rank(),
            "losses": losses if last_stage else None,
            "grad_norms": grad_norms,
            "digest": _digest(chunks),
            "params": sum(p.numel() for c in chunks for p in c.parameters()),
            "facts": _facts(ps),
            "seconds": {"setup": round(t1 - t0, 3), "steps": round(time.perf_counter() - t1, 3)},
        }
    finally:
        ps.destroy_model_parallel()


@contextlib.contextmanager
def parallel_state_impl(impl: str, install: str = "after") -> Iterator[None]:
    """Inside the block Megatron uses MCore's own parallel_state (``impl="mcore"``) or compat,
    installed before megatron is first imported (``install="before"``: the process must not
    have imported megatron yet) or after importing it; compat is uninstalled on exit.
    """
    import compat

    if impl == "mcore":
        if compat.is_installed():
            raise RuntimeError("impl='mcore' but compat is installed")
        import megatron.core.parallel_state  # noqa: F401

        yield
        return
    if install == "before":
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "megatron")
        if loaded:
            raise RuntimeError(f"install='before' needs a process without megatron; loaded: {loaded[:3]}")
    else:
        import megatron.core.parallel_state  # noqa: F401  (megatron first)
    compat.install()
    try:
        import megatron.core.parallel_state as ps  # with "before": megatron's first import

        if ps is not sys.modules["compat.parallel_state"]:
            raise RuntimeError("compat.install() did not take effect")
        yield
    finally:
        compat.uninstall()


def run_once(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg`` with whatever parallel_state megatron currently uses (see
    :func:`parallel_state_impl`); the result of :func:`train_rank`.
    """
    if dist.get_world_size() != cfg.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} != tp * pp * dp = {cfg.world_size}")
    torch.set_num_threads(1)
    before = set(dist.distributed_c10d._world.pg_map)
    with CpuShims() as shims:
        shims.patch_megatron()
        with shims.cuda_to_cpu():
            if cfg.groups == "collection":
                from gpt_collection import train_collection

                result = train_collection(cfg)
            else:
                result = _train(cfg)
    leaked = set(dist.distributed_c10d._world.pg_map) - before
    for group in leaked:
        dist.destroy_process_group(group)
    result["leaked_groups"] = len(leaked)
    return result


def train_rank(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` on this rank of the current gloo world (see the module doc), with the
    parallel_state ``cfg.impl`` / ``cfg.install`` ask for.

    Returns ``rank``, ``losses`` (per step, last pipeline stage only, mean over microbatches and
    data-parallel ranks; ``None`` elsewhere), ``grad_norms``, ``digest`` (this rank's final
    parameters), ``params`` (local parameter count), ``facts`` (which parallel_state module
    megatron's code resolved to during the run), ``seconds`` (setup, steps) and
    ``leaked_groups`` (process groups still alive after ``destroy_model_parallel``; they are
    destroyed here so the world can be reused).
    """
    _use_megatron_path(cfg.megatron_path)
    with parallel_state_impl(cfg.impl, cfg.install):
        return run_once(cfg)


VARIANTS = {"compat-before": ("compat", "before"), "mcore": ("mcore", "after"), "compat-after": ("compat", "after")}


def train_collection_and_globals(cfgs: list[TrainConfig]) -> dict[str, list[dict]]:
    """Run every config from a ProcessGroupCollection (no globals), then with MCore's globals.

    The collection runs come first, while Megatron's globals were never set in this process
    (a global read would then find nothing rather than another run's groups).
    ``{"collection": [...], "globals": [...]}``, one result per config.
    """
    if cfgs:
        _use_megatron_path(cfgs[0].megatron_path)
    with parallel_state_impl("mcore"):
        collection = [run_once(cfg.replace(impl="mcore", groups="collection")) for cfg in cfgs]
        return {
            "collection": collection,
            "globals": [run_once(cfg.replace(impl="mcore", groups="globals")) for cfg in cfgs],
        }


def train_variants(cfgs: list[TrainConfig], variants: tuple[str, ...] = tuple(VARIANTS)) -> dict[str, list[dict]]:
    """Run every config under each variant of :data:`VARIANTS`, in order (``compat-before``
    first: the process must not have imported megatron); ``{variant: [result per config]}``.
    compat stays installed across all configs of a compat variant.
    """
    if cfgs:
        _use_megatron_path(cfgs[0].megatron_path)
    out: dict[str, list[dict]] = {}
    for variant in variants:
        impl, install = VARIANTS[variant]
        with parallel_state_impl(impl, install):
            out[variant] = [run_once(cfg.replace(impl=impl, install=install)) for cfg in cfgs]
    return out
