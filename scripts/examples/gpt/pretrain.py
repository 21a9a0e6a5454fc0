"""One rank of Megatron-LM's own training loop (``megatron.training.pretrain``) on CPU, gloo.

:func:`pretrain_rank` is what ``python -m scripts.examples train_gpt --loop training`` runs in every
process it starts: the user side of a ``pretrain_gpt.py``-style program (defaults for a tiny CPU
model, :func:`model_provider`, :func:`dataset_provider`, :func:`forward_step`); ``pretrain`` does
everything else. CPU stand-ins: :mod:`parallel_state_ng.testing.megatron_cpu` (``CpuShims`` plus
``TrainingShims``). What it writes and records: docs/results/training.md (Megatron-LM's training loop).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

# Megatron options every CPU run needs (a user option given later on the command line wins
# where argparse allows it): gloo, no fused kernels, no TransformerEngine, no data workers, no
# evaluation, a log line per iteration.
CPU_DEFAULTS = [
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--num-workers",
    "0",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--log-interval",
    "1",
    "--tokenizer-type",
    "NullTokenizer",
]
# A tiny GPT (the core loop's model); every value can be overridden on the command line.
TINY_MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--vocab-size",
    "127",
    "--make-vocab-size-divisible-by",
    "64",
    "--position-embedding-type",
    "learned_absolute",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "3",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-3",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0.01",
    "--adam-beta2",
    "0.95",
    "--clip-grad",
    "1.0",
    "--seed",
    "1234",
    "--init-method-std",
    "0.02",
]


class ArithmeticTokens(torch.utils.data.Dataset):
    """``length`` samples; sample ``i`` is ``(start + stride * j) % vocab`` for ``j`` in
    ``0 .. seq``, with ``start`` and ``stride`` drawn from a generator seeded by (seed, i).
    Items are dicts of CPU tensors in the layout ``GPTModel`` takes.
    """

    def __init__(self, length: int, seq: int, vocab: int, seed: int) -> None:
        self.length, self.seq, self.vocab, self.seed = length, seq, vocab, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        start = int(torch.randint(self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        seq = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return {
            "tokens": seq[:-1].contiguous(),
            "labels": seq[1:].contiguous(),
            "loss_mask": torch.ones(self.seq),
            "position_ids": torch.arange(self.seq),
        }


_BUILT: list[torch.nn.Module] = []  # the model chunks model_provider built, in order


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, **kwargs: Any):
    """A ``GPTModel`` (local layer spec) for this pipeline stage / virtual chunk."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = kwargs.get("config") or core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts)
    extra = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(GPTModel.__init__).parameters else {}
    if kwargs.get("pg_collection") is not None and "pg_collection" in inspect.signature(GPTModel.__init__).parameters:
        extra["pg_collection"] = kwargs["pg_collection"]
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        **extra,
    )
    _BUILT.append(model)
    return model


def dataset_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None):
    """Train / valid / test datasets (valid and test only when Megatron asks for samples)."""
    from megatron.training import get_args

    args = get_args()
    vocab = args.vocab_size or 128
    return tuple(
        ArithmeticTokens(int(n), args.seq_length, vocab, args.seed + 7 * split) if n else None
        for split, n in enumerate(train_val_test_num_samples)
    )


dataset_provider.is_distributed = True  # type: ignore[attr-defined]  # every rank builds its own


def _loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    mask = loss_mask.view(-1).float()
    total = torch.sum(output_tensor.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.cat([total.detach().view(1), tokens.float().view(1)])}


def forward_step(data_iterator, model):
    """One microbatch: the model's per-token losses and Megatron's loss function for them."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, lambda output_tensor: _loss(batch["loss_mask"], output_tensor)


class _LogRecorder:
    """Wraps ``megatron.training.training.training_log`` to keep what it is given per
    iteration: the reduced losses (last pipeline stage) and the gradient norm.
    """

    def __init__(self) -> None:
        self.iterations: list[dict[str, Any]] = []
        self.seconds: list[float] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from megatron.training import training

        original = training.training_log
        signature = inspect.signature(original)
        last = [time.perf_counter()]

        def recording(*args: Any, **kwargs: Any):
            bound = signature.bind(*args, **kwargs)
            losses = {k: float(v) for k, v in (bound.arguments.get("loss_dict") or {}).items()}
            norm = bound.arguments.get("grad_norm")
            now = time.perf_counter()
            self.seconds.append(now - last[0])
            last[0] = now
            self.iterations.append(
                {
                    "iteration": int(bound.arguments["iteration"]),
                    "losses": losses,
                    "grad_norm": None if norm is None else float(norm),
                }
            )
            return original(*args, **kwargs)

        training.training_log = recording
        try:
            yield
        finally:
            training.training_log = original


class SleepWakeHook:
    """Every communicator asleep and awake again between ``pretrain``'s iterations (issue 51).

    The hook point is the release's own per-iteration one: ``train()`` calls
    ``megatron.training.training.post_training_step_callbacks`` once per iteration on every
    rank, after the optimizer step and ``training_log`` and before the next iteration's first
    collective (0.17 to 0.19); :meth:`installed` wraps it, as an RL job puts the rollout there.
    After Megatron's callbacks each rank calls
    :func:`~scripts.examples.gpt.model.sleep_and_wake` (``compat.parallel_state``'s
    ``sleep_model_parallel``, a refused collective, ``wake_model_parallel``). ``cycles``: how
    many ran; ``mechanisms``: the sleep reports' mechanisms (``{mechanism: groups}``, the last).
    """

    def __init__(self) -> None:
        self.cycles = 0
        self.mechanisms: dict[str, int] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """``post_training_step_callbacks`` wrapped inside the block, Megatron's own again after it."""
        from megatron.training import training

        from scripts.examples.gpt.model import sleep_and_wake

        original = training.post_training_step_callbacks

        def then_sleep_and_wake(*args: Any, **kwargs: Any):
            result = original(*args, **kwargs)
            report = sleep_and_wake()
            self.cycles += 1
            self.mechanisms = {m: len(report.by_mechanism(m)) for m in {g.mechanism for g in report.groups}}
            return result

        training.post_training_step_callbacks = then_sleep_and_wake
        try:
            yield
        finally:
            training.post_training_step_callbacks = original


def _digest(chunks: list[torch.nn.Module]) -> str:
    h = hashlib.sha256()
    for i, chunk in enumerate(chunks):
        for name, param in sorted(chunk.named_parameters()):
            t = param.detach().contiguous().cpu()
            h.update(f"{i}:{name}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def pretrain_rank(
    rank: int,
    world_size: int,
    store_path: str | None,
    megatron_args: list[str],
    impl: str,
    install: str,
    sleep_wake: bool = False,
):
    """Run ``megatron.training.pretrain`` as rank ``rank`` of ``world_size``; returns this
    rank's record: ``iterations`` (per iteration: losses reported, gradient norm), ``digest``,
    ``facts`` (which parallel_state megatron used), ``seconds`` (import, pretrain).

    ``store_path`` None: a launcher started the process (its ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``... stand; Megatron joins through env://), and the records of every rank
    come back, in rank order, instead of this rank's.

    The command line goes to Megatron's own parser after :data:`CPU_DEFAULTS` and
    :data:`TINY_MODEL`, which any user option overrides. ``pretrain`` gets the ``FileStore`` as
    ``store=``; losses and gradient norm are recorded by wrapping ``training_log``; the digest is
    a SHA-256 of this rank's final parameters, taken after ``pretrain`` returns. ``sleep_wake``
    (compat only): every communicator asleep and awake again after each iteration
    (:class:`SleepWakeHook`); the record's ``sleep`` gives the cycles and mechanisms.
    """
    import torch.distributed as dist

    from parallel_state_ng.testing.megatron_cpu import CpuShims, TrainingShims
    from scripts.examples.gpt.training import parallel_state_impl

    # what a launcher (torchrun) and a GPU job set; tp > 1 on a pre-Blackwell device asks for
    # CUDA_DEVICE_MAX_CONNECTIONS=1 (see TrainingShims)
    if store_path is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    store = None if store_path is None else dist.FileStore(store_path, world_size)
    sys.argv = ["pretrain_gpt.py", *CPU_DEFAULTS, *TINY_MODEL, *megatron_args]
    recorder = _LogRecorder()
    hook = SleepWakeHook()
    with CpuShims() as shims, TrainingShims() as training_shims:
        with parallel_state_impl(impl, install):
            shims.patch_megatron()
            training_shims.patch_megatron()
            from megatron.core import parallel_state as ps
            from megatron.core.enums import ModelType
            from megatron.training import pretrain

            t1 = time.perf_counter()
            hooked = hook.installed() if sleep_wake else contextlib.nullcontext()
            with shims.cuda_to_cpu(), recorder.installed(), hooked:
                _call_pretrain(pretrain, ModelType.encoder_or_decoder, store)
            t2 = time.perf_counter()
            last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
            facts = {"parallel_state": ps.__name__, "training.mpu": _training_mpu(), "version": _version()}
            ps.destroy_model_parallel()
    record = {
        "rank": rank,
        "last_stage": last_stage,
        "iterations": recorder.iterations,
        "digest": _digest(_BUILT),
        "facts": facts,
        "seconds": {"import": round(t1 - t0, 3), "pretrain": round(t2 - t1, 3)},
        "iteration_seconds": [round(s, 4) for s in recorder.seconds],
        "sleep": {"cycles": hook.cycles, "mechanisms": hook.mechanisms},
    }
    if store_path is None:
        from parallel_state_ng.groups.objects import all_gather_objects

        records = all_gather_objects(record)
        dist.destroy_process_group()
        return records
    dist.destroy_process_group()
    return record


def _call_pretrain(pretrain: Any, model_type: Any, store: Any) -> None:
    """Call ``pretrain`` the way the release in use expects.

    Up to 0.17 ``pretrain(dataset_provider, model_provider, model_type, forward_step, ...)``
    parses the command line itself (in ``initialize_megatron``). From 0.18 on its first
    parameter is a ``PretrainConfigContainer`` and ``initialize_megatron`` reads arguments that
    must already be set: the caller parses and validates them
    (``arguments.parse_and_validate_args``, which also sets Megatron's globals) and builds the
    container from them (``argument_utils.pretrain_cfg_container_from_args``). 0.19 also moved
    ``model_provider`` after ``forward_step_func``, so every provider is passed by name.
    """
    providers = {
        "train_valid_test_dataset_provider": dataset_provider,
        "model_provider": model_provider,
        "model_type": model_type,
        "forward_step_func": forward_step,
        "store": store,
    }
    params = list(inspect.signature(pretrain).parameters)
    if params[0] != "cfg_container":
        pretrain(**providers)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args()
    pretrain(pretrain_cfg_container_from_args(args), **providers)


def _version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _training_mpu() -> str:
    from megatron.training import training

    return training.mpu.__name__
