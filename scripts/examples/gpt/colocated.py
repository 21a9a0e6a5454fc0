"""One rank of an RL-shaped job: train in one parallel layout, run inference in another, same ranks.

:func:`train_and_infer_rank` runs in every process of a gloo world (megatron-core 0.19+, the
collection path of :mod:`scripts.examples.gpt.collection`, no Megatron globals):

1. the communicators each layout creates on the rank, both layouts built and destroyed under
   each group-sharing setting: off, per build (``1``) and the process-wide registry
   (``process``) (:func:`count_communicators`, measured in torch's table of live groups);
2. the reference run: ``cfg.steps`` training steps over ``build_megatron_groups``, sharing off;
3. the same run again under the process-wide registry, with an inference phase after step
   ``cfg.steps - 1`` (:func:`inference_phase`): the inference layout's groups from
   :func:`parallel_state_ng.builders.inference.build_inference_collection` with the training's
   timeout (so the registry gives it the training layout's communicators), the weights moved
   into a tp ``infer_tp`` pp 1 ``GPTModel`` (:func:`full_weights`, :func:`load_weights`), a
   forward pass on a fixed batch compared with a one-rank model holding the same full weights,
   the inference groups destroyed (the registry must then hold exactly the training layout's
   groups, all alive); then the last training step. Once the weights are gathered, the training
   groups that the inference layout does not borrow sleep until it is destroyed (issue 51);
4. then, optionally, sleep/wake cycles of the whole training layout, this process's threads,
   sockets, descriptors and groups counted awake and asleep (:func:`sleep_cycles`).

See docs/results/training.md ("Training and inference layouts in one job").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scripts.examples.gpt.config import TrainConfig
from scripts.examples.gpt.model import _batch, digest, global_param_name, train_steps, transformer_config

#: Logits of the inference layout and of the one-rank model may differ by this much (float32:
#: the row-parallel layers sum ``infer_tp`` partial products in another order).
LOGITS_TOLERANCE = 1e-4
#: The fixed inference batch of data-parallel replica ``d`` is microbatch ``d`` of this step.
INFERENCE_STEP = 10_000
#: The training layout's ``distributed_timeout_minutes``; the inference groups get the same
#: timeout, which the registry requires to share a communicator.
TIMEOUT_MINUTES = 30
#: Group-sharing settings measured by :func:`count_communicators` (label -> set_group_sharing's value).
SHARING = {"off": "off", "per build (1)": "build", "process-wide registry": "process"}


def live_groups() -> set:
    """The process groups alive in this process, the default (world) group left out."""
    world = dist.distributed_c10d._world
    return set(world.pg_map) - {dist.group.WORLD}


def _training_groups(cfg: TrainConfig):
    from parallel_state_ng import build_megatron_groups

    return build_megatron_groups(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        distributed_timeout_minutes=TIMEOUT_MINUTES,
    )


def _inference_collection(world_size: int, infer_tp: int, rank_offset: int = 0):
    """The inference layout's collection, its groups with the training's timeout (our extension)."""
    from parallel_state_ng.builders.inference import build_inference_collection

    return build_inference_collection(
        world_size, tp_size=infer_tp, pp_size=1, cp_size=1, ep_size=1, expt_tp_size=1, rank_offset=rank_offset,
        timeout=timedelta(minutes=TIMEOUT_MINUTES),
    )  # fmt: skip


def registry_check(training: set) -> dict[str, Any]:
    """After the inference layout's destroy: the registry's communicators and the live groups against ``training``."""
    from parallel_state_ng.groups import registry

    held = {group for _, group, _ in registry.entries()}
    alive = live_groups()
    return {
        "registry holds": len(held),
        "training groups": len(training),
        "exactly training": held == training and training <= alive,
        "holders": sorted({holders for _, _, holders in registry.entries()}),
    }


def count_communicators(cfg: TrainConfig, infer_tp: int) -> dict[str, dict[str, Any]]:
    """Process groups this rank creates for the training layout, the inference layout and both.

    Both layouts are built (no training) and destroyed once per setting of :data:`SHARING`
    (:func:`~parallel_state_ng.groups.sharing.set_group_sharing`), in one process. Measured:
    the groups torch's table of live groups gains with each build (a communicator the registry
    hands out again is not new there). ``"inference shared"``: how many of the inference
    collection's ``"inference distinct"`` groups are training groups; with the registry, ``"after destroy"`` is
    :func:`registry_check` once the inference layout is destroyed.
    """
    from parallel_state_ng.builders.inference import destroy_inference_collection
    from parallel_state_ng.groups.sharing import set_group_sharing

    out: dict[str, dict[str, Any]] = {}
    for label, mode in SHARING.items():
        previous = set_group_sharing(mode)
        try:
            base = live_groups()
            groups = _training_groups(cfg)
            training = live_groups() - base
            collection = _inference_collection(dist.get_world_size(), infer_tp)
            inference = live_groups() - base - training
            fields = {pg for pg in vars(collection).values() if isinstance(pg, dist.ProcessGroup)}
            out[label] = {
                "training": len(training),
                "inference": len(inference),
                "both": len(training | inference),
                "inference shared": len(fields & training),
                "inference distinct": len(fields),
            }
            destroy_inference_collection(collection)
            if mode == "process":
                out[label]["after destroy"] = registry_check(training)
            groups.destroy()
            if live_groups() != base:
                raise RuntimeError(f"{len(live_groups() - base)} group(s) left after destroying both layouts")
        finally:
            set_group_sharing(previous)
    return out


def full_weights(chunks: list, pgc, names: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every full parameter of the training model (``chunks`` over ``pgc``), on every rank.

    ``names``: the full model's parameters (global name -> shape), in one order on every rank.
    Per parameter: an ``all_gather`` over ``pgc.tp`` concatenated along its partition
    dimension (tensor-parallel parameters only); then, per name, the pipeline stage that owns it
    (the lowest holding it: one ``all_reduce(MIN)`` over ``pgc.pp`` for all names) broadcasts it
    over ``pgc.pp``.
    """
    tp_size, pp_size, pp_rank = pgc.tp.size(), pgc.pp.size(), pgc.pp.rank()
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            value = param.detach()
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                parts = [torch.empty_like(value) for _ in range(tp_size)]
                dist.all_gather(parts, value.contiguous(), group=pgc.tp)
                value = torch.cat(parts, dim=param.partition_dim)
            local.setdefault(global_param_name(chunk, name), value)
    order = list(names)
    owners = torch.tensor([pp_rank if n in local else pp_size for n in order], dtype=torch.int64)
    dist.all_reduce(owners, op=dist.ReduceOp.MIN, group=pgc.pp)
    pp_ranks = dist.get_process_group_ranks(pgc.pp)
    out = {}
    for name, owner in zip(order, owners.tolist(), strict=True):
        if owner == pp_size:
            raise RuntimeError(f"no pipeline stage of the training model holds {name!r}")
        value = local[name].clone() if owner == pp_rank else torch.empty(names[name])
        if tuple(value.shape) != tuple(names[name]):
            raise RuntimeError(f"{name}: gathered shape {tuple(value.shape)}, the full model's {tuple(names[name])}")
        dist.broadcast(value, src=pp_ranks[owner], group=pgc.pp)
        out[name] = value
    return out


def load_weights(model, weights: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> int:
    """Copy into ``model`` (one pipeline stage) its tensor-parallel shard of each full weight."""
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = weights[global_param_name(model, name)]
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            param.copy_(full)
            count += 1
    return count


def _gpt(cfg: TrainConfig, pgc):
    """A one-stage ``GPTModel`` of ``cfg``'s sizes over the collection ``pgc`` (tp = ``cfg.tp``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=transformer_config(cfg.replace(pp=1, vpp=None)),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=cfg.vocab,
        max_sequence_length=cfg.seq,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
        pg_collection=pgc,
    )


def _logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], None, runtime_gather_output=True)


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Inside the block the RNG may be used freely: the CPU generator (the "CUDA" one under the
    CPU shims) and Megatron's tensor-parallel RNG tracker get their states back on exit.
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    with torch.random.fork_rng(devices=[]):
        yield
    tracker.set_states(states)


def _fields(collection) -> set:
    """The process groups a collection holds."""
    return {pg for pg in vars(collection).values() if isinstance(pg, dist.ProcessGroup)}


def inference_phase(cfg: TrainConfig, chunks: list, pgc, infer_tp: int, training: set | None = None) -> dict[str, Any]:
    """Build the inference layout, move the weights, run a forward pass, destroy the layout.

    The one-rank reference model (tp 1 pp 1) lives on a one-rank window of the same builder
    (``world_size=1, rank_offset=rank``) and is destroyed with it. With ``training`` (the
    training layout's groups), once the weights are gathered the training groups that neither
    inference collection holds sleep (:func:`parallel_state_ng.groups.sleep.sleep`, every rank
    together) until the inference layout is destroyed, and wake then (also on error): the
    communicators the registry lent the inference layout stay awake for it. ``"sleep"`` in the
    result: the groups asleep and awake, mechanisms, seconds, and this process's resources
    (:func:`~parallel_state_ng.testing.resources.process_resources`) awake, asleep and woken.
    """
    from parallel_state_ng.builders.inference import destroy_inference_collection
    from parallel_state_ng.groups import sleep as sleeping
    from parallel_state_ng.testing.resources import process_resources

    rank = dist.get_rank()
    t0 = time.perf_counter()
    collection = single = None
    slept: dict[str, Any] | None = None
    try:
        collection = _inference_collection(dist.get_world_size(), infer_tp)
        single = _inference_collection(1, 1, rank_offset=rank)
        model = _gpt(cfg.replace(tp=infer_tp), collection)
        reference = _gpt(cfg.replace(tp=1), single)
        names = {name: param.shape for name, param in reference.named_parameters()}
        weights = full_weights(chunks, pgc, names)
        if training is not None:
            lent = _fields(collection) | _fields(single)
            slept = {"awake": process_resources(), "training groups": len(training)}
            t1 = time.perf_counter()
            report = sleeping.sleep(sorted(training - lent, key=lambda g: str(g.group_name)), timeout=120)
            slept["sleep seconds"] = round(time.perf_counter() - t1, 4)
            slept["asleep"] = process_resources()
            slept["mechanisms"] = {m: len(report.by_mechanism(m)) for m in {g.mechanism for g in report.groups}}
            slept["slept groups"] = len(report.groups) - len(report.by_mechanism("skipped"))
            slept["lent awake"] = len(training & lent)
            slept["refused"] = _refused(training - lent)
        moved = load_weights(model, weights, collection.tp.rank(), infer_tp)
        load_weights(reference, weights, 0, 1)
        dp_rank = collection.dp.rank()
        batch = _batch(cfg, INFERENCE_STEP, dp_rank)
        logits, expected = _logits(model, batch), _logits(reference, batch)
        diff = float((logits - expected).abs().max())
        result = {
            "inference ranks": {
                "tp": dist.get_process_group_ranks(collection.tp),
                "dp": dist.get_process_group_ranks(collection.dp),
            },
            "dp rank": dp_rank,
            "logits shape": list(logits.shape),
            "max abs diff": diff,
            "params moved": moved,
            "full params": len(names),
        }
    finally:
        destroy_inference_collection(collection)
        destroy_inference_collection(single)
        if slept is not None:
            t2 = time.perf_counter()
            woken = sleeping.wake(timeout=120)
            slept["wake seconds"] = round(time.perf_counter() - t2, 4)
            slept["woken groups"] = len(woken.groups) - len(woken.by_mechanism("skipped"))
            slept["woken"] = process_resources()
    result["seconds"] = round(time.perf_counter() - t0, 3)
    result["sleep"] = slept
    return result


def _refused(groups: set) -> bool:
    """Whether a collective on one of ``groups`` (asleep) is refused at once (``True`` when none)."""
    from parallel_state_ng.groups.sleep import GroupAsleepError

    if not groups:
        return True
    try:
        dist.all_reduce(torch.ones(1), group=min(groups, key=lambda g: str(g.group_name)))
    except GroupAsleepError:
        return True
    return False


def sleep_cycles(groups, cycles: int) -> dict[str, Any]:
    """``cycles`` sleep/wake cycles of a layout (``MegatronGroups``) after a warm-up one: this
    process's resources awake and asleep at the first cycle and the last, the mean seconds of a
    sleep and of a wake (each with its agreement round).
    """
    from parallel_state_ng.testing.resources import process_resources

    groups.sleep(timeout=120)  # the warm-up: each group's guard is made at its first sleep
    groups.wake(timeout=120)
    counts: dict[str, list] = {"awake": [], "asleep": []}
    seconds = {"sleep": 0.0, "wake": 0.0}
    for cycle in range(cycles):
        ends = cycle in (0, cycles - 1)
        if ends:
            counts["awake"].append(process_resources())
        t0 = time.perf_counter()
        groups.sleep(timeout=120)
        t1 = time.perf_counter()
        if ends:
            counts["asleep"].append(process_resources())
        t2 = time.perf_counter()
        groups.wake(timeout=120)
        seconds["sleep"] += t1 - t0
        seconds["wake"] += time.perf_counter() - t2
    counts["awake"].append(process_resources())  # after the last wake
    return {
        "cycles": cycles,
        **counts,
        "mean seconds": {k: round(v / max(cycles, 1), 5) for k, v in seconds.items()},
    }


def train_run(cfg: TrainConfig, infer_tp: int | None, cycles: int = 0) -> dict[str, Any]:
    """``cfg.steps`` steps from ``build_megatron_groups``; with ``infer_tp``, :func:`inference_phase`
    (the training groups it does not use asleep) before the last step and :func:`registry_check`
    after it, then ``cycles`` :func:`sleep_cycles` of the whole training layout. Losses (last
    stage), gradient norms and the digest, per step phase.
    """
    from scripts.examples.gpt.collection import collection_training

    base = live_groups()
    groups = _training_groups(cfg)
    training = live_groups() - base
    try:
        pgc = groups.collection()
        chunks, model, optimizer, forward_backward = collection_training(cfg, pgc)
        last_stage = pgc.pp.rank() == cfg.pp - 1
        reporter = last_stage and pgc.tp.rank() == 0 and pgc.dp.rank() == 0
        first = cfg.steps - 1
        losses, norms = train_steps(cfg.replace(steps=first), model, optimizer, forward_backward, last_stage, pgc.dp,
                                    reporter)  # fmt: skip
        digest_before = digest(chunks)
        inference = None
        if infer_tp is not None:
            with rng_kept():
                inference = inference_phase(cfg, chunks, pgc, infer_tp, training)
            inference["after destroy"] = registry_check(training)
            if digest(chunks) != digest_before:
                raise RuntimeError("the inference phase changed the training parameters")
        more_losses, more_norms = train_steps(cfg.replace(steps=1), model, optimizer, forward_backward, last_stage,
                                              pgc.dp, reporter, first_step=first)  # fmt: skip
        return {
            "losses": losses + more_losses if last_stage else None,
            "grad_norms": norms + more_norms,
            "digest": digest(chunks),
            "inference": inference,
            "cycles": sleep_cycles(groups, cycles) if cycles else None,
        }
    finally:
        groups.destroy()
        left = live_groups() - base
        if left:
            raise RuntimeError(f"{len(left)} process group(s) left after the run")


def train_and_infer_rank(cfg: TrainConfig, infer_tp: int, cycles: int = 0) -> dict[str, Any]:
    """This rank's part of the job (see the module doc): communicators, the run without (sharing
    off) and with the inference phase (the process-wide registry on; then ``cycles`` sleep/wake
    cycles). Returns ``rank``, ``communicators``, ``reference`` and ``with_inference``.
    """
    from parallel_state_ng.testing.megatron_cpu import CpuShims, use_megatron_path

    use_megatron_path(cfg.megatron_path)
    torch.set_num_threads(1)
    with CpuShims() as shims:
        shims.patch_megatron()
        with shims.cuda_to_cpu():
            from megatron.core import parallel_state as ps

            from parallel_state_ng import ensure_global_memory_buffer
            from parallel_state_ng.groups.sharing import set_group_sharing
            from scripts.examples.gpt.collection import require_collection_release

            require_collection_release()
            ensure_global_memory_buffer()
            try:
                t0 = time.perf_counter()
                communicators = count_communicators(cfg, infer_tp)
                t1 = time.perf_counter()
                reference = train_run(cfg, None)
                t2 = time.perf_counter()
                previous = set_group_sharing("process")  # the run with inference: the registry on
                try:
                    with_inference = train_run(cfg, infer_tp, cycles)
                finally:
                    set_group_sharing(previous)
                t3 = time.perf_counter()
            finally:
                ps.destroy_global_memory_buffer()
            globals_set = ps.model_parallel_is_initialized()
    return {
        "rank": dist.get_rank(),
        "communicators": communicators,
        "reference": reference,
        "with_inference": with_inference,
        "globals initialized": globals_set,
        "seconds": {"count": round(t1 - t0, 3), "reference": round(t2 - t1, 3), "with inference": round(t3 - t2, 3)},
    }
