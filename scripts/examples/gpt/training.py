"""One rank of a tiny Megatron-Core GPT training run on CPU (gloo), under MCore or compat.

:func:`train_rank` runs in every process of an initialized gloo world and does what a Megatron
training loop does, through Megatron's globals (``initialize_model_parallel``; with
``cfg.impl == "compat"`` after ``compat.install()``). CPU stand-ins for CUDA come from
:mod:`parallel_state_ng.testing.megatron_cpu`; the data, model config and step loop from
:mod:`scripts.examples.gpt.model`. See docs/results/training.md (the core loop).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from parallel_state_ng.testing.megatron_cpu import CpuShims, use_megatron_path
from scripts.examples.gpt.config import TrainConfig
from scripts.examples.gpt.model import (
    ddp_config,
    digest,
    optimizer_config,
    set_weights_from_global_names,
    train_steps,
    transformer_config,
)


def build_model(cfg: TrainConfig, tcfg) -> list:
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


def seeded_model_and_optimizer(cfg: TrainConfig, seed: int, device: str = "cpu") -> tuple[list, list, Any]:
    """``(chunks, model, optimizer)`` over the current state: torch and Megatron's RNGs seeded with
    ``seed``, weights from their global names, the chunks on ``device``, each wrapped in Megatron's
    ``DistributedDataParallel`` (the config's no-sync and grad-finalize hooks set), then Megatron's
    optimizer.
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    tcfg = transformer_config(cfg)
    chunks = build_model(cfg, tcfg)
    set_weights_from_global_names(cfg, chunks)
    if device != "cpu":
        chunks = [chunk.to(device) for chunk in chunks]
    model = [DistributedDataParallel(tcfg, ddp_config(cfg), chunk) for chunk in chunks]
    tcfg.no_sync_func = model[0].no_sync
    tcfg.finalize_model_grads_func = finalize_model_grads
    return chunks, model, get_megatron_optimizer(optimizer_config(cfg), model)


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


def _train(cfg: TrainConfig, device: str = "cpu") -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    in_init = (
        cfg.all_gather_group and "create_all_gather_group" in inspect.signature(ps.initialize_model_parallel).parameters
    )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        expert_model_parallel_size=cfg.ep,
        **({"create_all_gather_group": True} if in_init else {}),
    )
    t0 = time.perf_counter()
    try:
        twins = _all_gather_groups(cfg, ps, in_init)
        seed = cfg.seed + 100 * ps.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        tcfg = transformer_config(cfg)
        chunks = build_model(cfg, tcfg)
        if cfg.init_from_names:
            set_weights_from_global_names(cfg, chunks)
        if device != "cpu":
            chunks = [chunk.to(device) for chunk in chunks]
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
        losses, grad_norms = train_steps(
            cfg,
            model,
            optimizer,
            forward_backward,
            last_stage,
            dp_group,
            reporter,
            device=None if device == "cpu" else device,
        )
        return {
            "rank": dist.get_rank(),
            "losses": losses if last_stage else None,
            "grad_norms": grad_norms,
            "digest": digest(chunks),
            "params": sum(p.numel() for c in chunks for p in c.parameters()),
            "param_device": str(next(chunks[0].parameters()).device),
            "facts": _facts(ps),
            "groups": _group_identities(ps, twins),
            "seconds": {"setup": round(t1 - t0, 3), "steps": round(time.perf_counter() - t1, 3)},
        }
    finally:
        ps.destroy_model_parallel()


def _all_gather_groups(cfg: TrainConfig, ps, in_init: bool) -> dict[str, Any]:
    """The all-gather twins ``cfg.all_gather_group`` asks for, made as ``megatron.training`` makes them.

    0.16-0.17: by ``initialize_model_parallel(create_all_gather_group=True)``; 0.18+:
    ``create_all_gather_groups(for_expert_parallelism=ep > 1, timeout=30 minutes)`` (the init's
    timeout). Megatron's DDP path does not use them (Megatron FSDP does, which needs CUDA): the
    run checks that making them changes nothing and that they stay their own groups.
    """
    if not cfg.all_gather_group:
        return {}
    if in_init:
        return {"dp_cp_ag": ps._DATA_PARALLEL_GROUP_WITH_CP_AG}
    if not hasattr(ps, "create_all_gather_groups"):
        raise RuntimeError("all_gather_group: this megatron-core has no all-gather groups (0.16+)")
    from datetime import timedelta

    dp_cp_ag, expt_dp_ag = ps.create_all_gather_groups(for_expert_parallelism=cfg.ep > 1, timeout=timedelta(minutes=30))
    return {"dp_cp_ag": dp_cp_ag, "expt_dp_ag": expt_dp_ag}


def _group_identities(ps, twins: dict[str, Any]) -> dict[str, bool]:
    """Which getters return one object: what a sharing setting changed, for the checks."""
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    out = {
        "dp is dp_cp": ps.get_data_parallel_group() is dp_cp,
        "ep is dp_cp": ps.get_expert_model_parallel_group() is dp_cp,
        "tp is tp_cp": ps.get_tensor_model_parallel_group() is ps.get_tensor_and_context_parallel_group(),
    }
    # the grad-statistics groups ChainedOptimizer compares with == (read as globals: a getter of an
    # unbuilt group asserts)
    mp = ps.get_model_parallel_group()
    for key, name in (
        ("mp is tp_ep_pp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP"),
        ("mp is intra_dist_opt", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"),
    ):
        other = getattr(ps, name, None)
        if other is not None:
            out[key] = mp is other
    if twins.get("dp_cp_ag") is not None:
        out["dp_cp_ag is dp_cp"] = twins["dp_cp_ag"] is dp_cp
    if twins.get("expt_dp_ag") is not None:
        out["expt_dp_ag is expt_dp"] = twins["expt_dp_ag"] is ps.get_expert_data_parallel_group()
    return out


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


def run_once(cfg: TrainConfig, device: str = "cpu") -> dict[str, Any]:
    """Train ``cfg`` with whatever parallel_state megatron currently uses (see
    :func:`parallel_state_impl`); the result of :func:`train_rank`.

    ``device``: ``"cpu"`` (the CPU stand-ins for CUDA, gloo) or a CUDA device such as
    ``"cuda:0"`` (Megatron as it is: parameters and microbatches moved there; the Megatron
    globals path only, as the GPU check uses it: :mod:`scripts.gpu.world_training`).
    """
    if dist.get_world_size() != cfg.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} != tp * pp * dp = {cfg.world_size}")
    torch.set_num_threads(1)
    with _share_setting(cfg.share):
        return _run_once(cfg, device)


@contextlib.contextmanager
def _share_setting(share: str | None) -> Iterator[None]:
    """``PSNG_SHARE_GROUPS=share`` inside the block (the environment variable, as a job sets it)."""
    if share is None:
        yield
        return
    saved = os.environ.get("PSNG_SHARE_GROUPS")
    os.environ["PSNG_SHARE_GROUPS"] = share
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PSNG_SHARE_GROUPS", None)
        else:
            os.environ["PSNG_SHARE_GROUPS"] = saved


def _run_once(cfg: TrainConfig, device: str) -> dict[str, Any]:
    before = set(dist.distributed_c10d._world.pg_map)
    if device != "cpu":
        if cfg.groups != "globals":
            raise ValueError(f"training on {device} runs Megatron's globals only, not groups={cfg.groups!r}")
        result = _train(cfg, device)
    else:
        with CpuShims() as shims:
            shims.patch_megatron()
            with shims.cuda_to_cpu():
                if cfg.groups == "collection":
                    from scripts.examples.gpt.collection import train_collection

                    result = train_collection(cfg)
                else:
                    result = _train(cfg)
    leaked = set(dist.distributed_c10d._world.pg_map) - before
    for group in leaked:
        dist.destroy_process_group(group)
    result["leaked_groups"] = len(leaked)
    return result


def train_rank(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` on this rank of the current gloo world, with the parallel_state ``cfg.impl`` /
    ``cfg.install`` ask for: ``initialize_model_parallel``, ``model_parallel_cuda_manual_seed``, a
    ``GPTModel`` with the local (non-TransformerEngine) layer spec per virtual pipeline chunk,
    Megatron's ``DistributedDataParallel`` with ``finalize_model_grads``, ``get_megatron_optimizer``
    (Adam, gradient clipping, optionally the distributed optimizer) and
    ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved 1F1B).

    Returns ``rank``, ``losses`` (per step, last pipeline stage only, mean over microbatches and
    data-parallel ranks; ``None`` elsewhere), ``grad_norms``, ``digest`` (this rank's final
    parameters), ``params`` (local parameter count), ``facts`` (which parallel_state module
    megatron's code resolved to during the run), ``seconds`` (setup, steps) and
    ``leaked_groups`` (process groups still alive after ``destroy_model_parallel``; they are
    destroyed here so the world can be reused).
    """
    use_megatron_path(cfg.megatron_path)
    with parallel_state_impl(cfg.impl, cfg.install):
        return run_once(cfg)


VARIANTS = {"compat-before": ("compat", "before"), "mcore": ("mcore", "after"), "compat-after": ("compat", "after")}
#: Variants that run compat installed after megatron's import under a ``PSNG_SHARE_GROUPS`` setting.
SHARED_VARIANTS = {"compat-safe": "safe", "compat-share1": "1"}


def train_collection_and_globals(cfgs: list[TrainConfig], served: bool = False) -> dict[str, list[dict]]:
    """Run every config from a ProcessGroupCollection, then with MCore's globals.

    The collection runs come first, while Megatron's globals were never set in this process
    (a global read would then find nothing rather than another run's groups). ``served``: the
    collection runs under compat (installed after megatron), which serves the collection as
    the globals through ``compat.use_collection`` (0.16+); else under MCore's own module with
    no globals (0.19+). ``{"collection": [...], "globals": [...]}``, one result per config.
    """
    if cfgs:
        use_megatron_path(cfgs[0].megatron_path)
    impl = "compat" if served else "mcore"
    with parallel_state_impl(impl):
        collection = [run_once(cfg.replace(impl=impl, groups="collection")) for cfg in cfgs]
    with parallel_state_impl("mcore"):
        return {
            "collection": collection,
            "globals": [run_once(cfg.replace(impl="mcore", groups="globals")) for cfg in cfgs],
        }


def train_variants(
    cfgs: list[TrainConfig], variants: tuple[str, ...] = tuple(VARIANTS), first_only: tuple[str, ...] = ()
) -> dict[str, list[dict]]:
    """Run every config under each variant of :data:`VARIANTS` or :data:`SHARED_VARIANTS`, in
    order (``compat-before`` first: the process must not have imported megatron);
    ``{variant: [result per config]}``.
    compat stays installed across all configs of a compat variant. The variants named in
    ``first_only`` run the first config only.
    """
    if cfgs:
        use_megatron_path(cfgs[0].megatron_path)
    out: dict[str, list[dict]] = {}
    for variant in variants:
        impl, install = VARIANTS.get(variant, ("compat", "after"))
        share = SHARED_VARIANTS.get(variant)
        with parallel_state_impl(impl, install):
            chosen = cfgs[:1] if variant in first_only else cfgs
            out[variant] = [run_once(cfg.replace(impl=impl, install=install, share=share)) for cfg in chosen]
    return out
