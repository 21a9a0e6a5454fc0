"""Options of the CPU GPT training example (``python -m scripts.examples train_gpt``) and their validation.

Importing this module imports neither torch nor megatron: options are checked before any
process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

IMPLS = ("mcore", "compat")
INSTALL_MODES = ("before", "after")
GROUP_SOURCES = ("globals", "collection")
DISPATCHERS = ("alltoall", "allgather")
#: ``PSNG_SHARE_GROUPS`` values a compat run may set (``None``: leave the environment as it is).
SHARE_SETTINGS = ("0", "safe", "1", "process")
MAX_WORLD_SIZE = 32


class TrainOptionError(ValueError):
    """Options that do not describe a run Megatron-Core can do on CPU processes."""


@dataclass(frozen=True)
class TrainConfig:
    """One training run: parallel layout, model size, schedule and which parallel_state.

    ``impl="mcore"`` uses megatron-core's own ``parallel_state``; ``impl="compat"`` runs the
    same code after ``compat.install()``, done before megatron is imported
    (``install="before"``) or after (``install="after"``). ``groups="collection"`` builds the
    same run without ``initialize_model_parallel``: groups from
    ``parallel_state_ng.build_megatron_groups`` passed as ``pg_collection=`` (with ``impl="mcore"``
    0.19+; with ``impl="compat"`` 0.16+, served as the globals by ``compat.use_collection``).
    ``overlap``: Megatron's ``overlap_grad_reduce`` (and ``overlap_param_gather`` with the
    distributed optimizer); ``all_gather_group``: the all-gather twins as ``megatron.training``
    makes them (0.16+); ``share``: ``PSNG_SHARE_GROUPS`` for the run (compat only).
    """

    impl: str = "mcore"
    groups: str = "globals"
    install: str = "after"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    ep: int = 1
    experts: int | None = None
    topk: int = 2
    dispatcher: str = "alltoall"
    dist_opt: bool = False
    overlap: bool = False
    all_gather_group: bool = False
    share: str | None = None
    steps: int = 3
    seed: int = 1234
    num_layers: int = 4
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 32
    micro_batch: int = 2
    microbatches: int = 4
    dropout: float = 0.0
    #: Linear layers with biases (Megatron's add_bias_linear). Off for MoE at expert tp 1: Megatron's
    #: MLP then adds the expert bias in place on a view the tp-1 reduce returned, which autograd refuses.
    bias: bool = True
    #: compat only: every communicator to sleep and awake again after each optimizer step
    #: (compat.parallel_state.sleep_model_parallel / wake_model_parallel), as an RL job between phases.
    sleep_wake: bool = False
    lr: float = 3e-3
    clip_grad: float = 1.0
    init_from_names: bool = False
    megatron_path: str | None = None
    verbose: bool = False

    @property
    def world_size(self) -> int:
        """Processes the run needs: tp * pp * dp."""
        return self.tp * self.pp * self.dp

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes`` applied (not validated)."""
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        """Short description of the layout, e.g. ``tp2 pp2 dp2 vpp2 dist-opt``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        if self.experts:
            parts.append(f"ep{self.ep} experts{self.experts} {self.dispatcher}")
        if self.dist_opt:
            parts.append("dist-opt")
        if self.overlap:
            parts.append("overlap")
        if self.all_gather_group:
            parts.append("ag-group")
        if self.share is not None:
            parts.append(f"share={self.share}")
        if self.dropout:
            parts.append(f"dropout{self.dropout:g}")
        if not self.bias:
            parts.append("no-bias")
        if self.sleep_wake:
            parts.append("sleep-wake")
        return " ".join(parts)


def _positive(errors: list[str], name: str, value, minimum: int = 1) -> bool:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        errors.append(f"--{name} must be an integer >= {minimum}, got {value!r}")
        return False
    return True


def validate(cfg: TrainConfig) -> TrainConfig:
    """Return ``cfg`` if Megatron-Core can run it on CPU processes, else raise
    :class:`TrainOptionError` listing every problem.
    """
    errors: list[str] = []
    if cfg.impl not in IMPLS:
        errors.append(f"--impl must be one of {', '.join(IMPLS)}, got {cfg.impl!r}")
    if cfg.install not in INSTALL_MODES:
        errors.append(f"--install must be one of {', '.join(INSTALL_MODES)}, got {cfg.install!r}")
    if cfg.groups not in GROUP_SOURCES:
        errors.append(f"--groups must be one of {', '.join(GROUP_SOURCES)}, got {cfg.groups!r}")
    if cfg.dispatcher not in DISPATCHERS:
        errors.append(f"--dispatcher must be one of {', '.join(DISPATCHERS)}, got {cfg.dispatcher!r}")
    ints = {
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "ep": cfg.ep,
        "steps": cfg.steps,
        "num-layers": cfg.num_layers,
        "hidden": cfg.hidden,
        "heads": cfg.heads,
        "vocab": cfg.vocab,
        "seq": cfg.seq,
        "micro-batch": cfg.micro_batch,
        "microbatches": cfg.microbatches,
        "topk": cfg.topk,
    }
    ok = all([_positive(errors, name, value) for name, value in ints.items()])
    if cfg.vpp is not None:
        ok = _positive(errors, "vpp", cfg.vpp, minimum=2) and ok
    if cfg.experts is not None:
        ok = _positive(errors, "experts", cfg.experts) and ok
    if not 0.0 <= cfg.dropout < 1.0:
        errors.append(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if not cfg.lr > 0:
        errors.append(f"--lr must be > 0, got {cfg.lr}")
    if cfg.share is not None and cfg.share not in SHARE_SETTINGS:
        errors.append(f"--share-groups must be one of {', '.join(SHARE_SETTINGS)}, got {cfg.share!r}")
    if cfg.share is not None and cfg.impl != "compat":
        errors.append(f"--share-groups {cfg.share} needs --impl compat (MCore shares nothing)")
    if cfg.sleep_wake and cfg.impl != "compat":
        errors.append("sleep_wake needs --impl compat (MCore has no sleep)")
    if ok:
        _check_layout(cfg, errors)
    if errors:
        raise TrainOptionError("invalid training options:\n  " + "\n  ".join(errors))
    return cfg


def _check_layout(cfg: TrainConfig, errors: list[str]) -> None:
    if cfg.world_size > MAX_WORLD_SIZE:
        errors.append(f"tp * pp * dp = {cfg.world_size} processes; at most {MAX_WORLD_SIZE} on CPU")
    if cfg.hidden % cfg.heads:
        errors.append(f"--hidden {cfg.hidden} is not divisible by --heads {cfg.heads}")
    if cfg.heads % cfg.tp:
        errors.append(f"--heads {cfg.heads} is not divisible by --tp {cfg.tp}")
    if cfg.vocab % cfg.tp:
        errors.append(f"--vocab {cfg.vocab} is not divisible by --tp {cfg.tp}")
    chunks = cfg.pp * (cfg.vpp or 1)
    if cfg.num_layers % chunks:
        errors.append(f"--num-layers {cfg.num_layers} is not divisible by pp * vpp = {chunks}")
    if cfg.vpp is not None:
        if cfg.pp < 2:
            errors.append("--vpp needs --pp > 1 (the interleaved schedule splits pipeline stages)")
        elif cfg.microbatches % cfg.pp:
            errors.append(f"--microbatches {cfg.microbatches} must be a multiple of --pp {cfg.pp} with --vpp")
    if cfg.experts is None:
        if cfg.ep > 1:
            errors.append("--ep > 1 needs --experts (a mixture-of-experts model)")
        return
    if cfg.tp > 1:
        errors.append(
            "--experts needs --tp 1: MoE with tensor parallelism requires sequence parallelism, "
            "whose norms need TransformerEngine/apex (not available on CPU)"
        )
    if cfg.dp % cfg.ep:
        errors.append(f"--ep {cfg.ep} does not divide the data-parallel size {cfg.dp}")
    if cfg.experts % cfg.ep:
        errors.append(f"--experts {cfg.experts} is not divisible by --ep {cfg.ep}")
    if cfg.topk > cfg.experts:
        errors.append(f"--topk {cfg.topk} exceeds --experts {cfg.experts}")
