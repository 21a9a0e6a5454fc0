"""Differential test: ``compat.parallel_state`` against Megatron-Core's ``parallel_state``.

For each configuration (world size 1 ... 1024, every argument of MCore 0.16.1's
``initialize_model_parallel``) and several ranks of it (first, last, a few seeded random
ones), in one process on the fake backend: init MCore on rank r, snapshot everything
observable (``tests/differential.py``), destroy; do the same with compat; the two must match.
A configuration MCore rejects must be rejected by compat with the same exception type (or a
subclass), and compat must be atomic: after its failed init the state is what it was before.
"""

from __future__ import annotations

import itertools
import math
import random
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest

import differential as D
import megatron.core.parallel_state as mcore_ps

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

# --------------------------------------------------------------------------- embedding callables
# MCore calls get_embedding_ranks(ranks) with one list of python ints per pipeline group. These
# callables refuse anything else, so a different call convention shows up as a mismatch.


def _checked(ranks: Any) -> list[int]:
    if type(ranks) is not list or not all(type(r) is int for r in ranks):
        raise TypeError(f"embedding-ranks callable got {type(ranks).__name__} {ranks!r}, expected list of int")
    return ranks


def emb_last(ranks):
    return [_checked(ranks)[-1]]


def emb_all(ranks):
    return list(_checked(ranks))


def emb_even(ranks):
    return _checked(ranks)[::2]


def emb_middle(ranks):
    ranks = _checked(ranks)
    return [ranks[len(ranks) // 2]]


def emb_first_and_second(ranks):
    return _checked(ranks)[:2]


def emb_empty(ranks):
    _checked(ranks)
    return []


EMBEDDING_CALLABLES: dict[str, Callable] = {
    f.__name__[4:]: f for f in (emb_last, emb_all, emb_even, emb_middle, emb_first_and_second, emb_empty)
}

YAMLS = {
    "other": "some_other_group:\n  max_ctas: 4\n",  # names no group MCore creates: no options
    "tp": "tp:\n  max_ctas: 4\n  min_ctas: 1\n",  # needs ProcessGroupNCCL.Options
    "empty": "",  # yaml.safe_load gives None
    "absent": None,  # the path does not exist
}

# --------------------------------------------------------------------------- configurations


@dataclass
class Config:
    """One ``initialize_model_parallel`` call on a fake world of ``world`` ranks."""

    world: int
    kwargs: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    cuda_stub: bool = False
    yaml: Optional[str] = None  # key of YAMLS: written to tmp_path, passed as the config path
    tag: str = ""  # extra id text for hand-written configs

    @property
    def id(self) -> str:
        k = self.kwargs
        parts = [f"w{self.world}"]
        for name, short in (
            ("tensor_model_parallel_size", "tp"),
            ("pipeline_model_parallel_size", "pp"),
            ("context_parallel_size", "cp"),
            ("expert_model_parallel_size", "ep"),
        ):
            parts.append(f"{short}{k.get(name, 1)}")
        if k.get("expert_tensor_parallel_size") is not None:
            parts.append(f"etp{k['expert_tensor_parallel_size']}")
        if k.get("virtual_pipeline_model_parallel_size") is not None:
            parts.append(f"vpp{k['virtual_pipeline_model_parallel_size']}")
        if "hierarchical_context_parallel_sizes" in k:
            parts.append("hcp" + "x".join(map(str, k["hierarchical_context_parallel_sizes"] or [])))
        if k.get("hybrid_context_parallel"):
            parts.append("hyb")
        if k.get("num_distributed_optimizer_instances", 1) != 1:
            parts.append(f"dopt{k['num_distributed_optimizer_instances']}")
        if k.get("distributed_timeout_minutes", 30) != 30:
            parts.append(f"to{k['distributed_timeout_minutes']}")
        if k.get("create_all_gather_group"):
            parts.append("ag")
        if k.get("create_gloo_process_groups"):
            parts.append("gloo")
        for name, short in (("get_embedding_ranks", "emb"), ("get_position_embedding_ranks", "pemb")):
            if k.get(name) is not None:
                parts.append(f"{short}_{k[name].__name__[4:]}")
        if k.get("pipeline_model_parallel_comm_backend") is not None:
            parts.append(f"ppb_{k['pipeline_model_parallel_comm_backend']}")
        if k.get("use_sharp"):
            parts.append("sharp")
        if k.get("sharp_enabled_group") is not None:
            parts.append(f"sg_{k['sharp_enabled_group']}")
        if self.cuda_stub:
            parts.append("cudastub")
        if k.get("high_priority_stream_groups") is not None:
            parts.append("hps_" + "+".join(k["high_priority_stream_groups"]))
        if self.yaml is not None:
            parts.append(f"cfg_{self.yaml}")
        for name, value in sorted(self.env.items()):
            parts.append(f"env_{name}={value}")
        if self.tag:
            parts.append(self.tag)
        parts.append(str(k.get("order", "tp-cp-ep-dp-pp")) or "EMPTYORDER")
        return "-".join(parts)

    def ranks(self) -> list[int]:
        """Ranks to compare: all of a small world, else first, last and seeded random ones."""
        w = self.world
        if w <= 4:
            return list(range(w))
        extra = 1 if w >= 512 else 2
        rng = random.Random(zlib.crc32(self.id.encode()))
        middle = rng.sample(range(1, w - 1), min(extra, w - 2))
        return [0, w - 1] + sorted(middle)


def _divisors(n: int, limit: int = 1 << 30) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d <= limit]


TOKENS = ("tp", "cp", "ep", "dp", "pp")
COMMON_ORDERS = ("tp-cp-ep-dp-pp", "tp-dp-pp", "tp-pp-dp", "tp-cp-ep-pp-dp", "tp-ep-cp-dp-pp", "cp-tp-ep-dp-pp")
ALL_ORDERS = ["-".join(p) for p in itertools.permutations(TOKENS)]

# world size -> number of random configurations
WORLD_PLAN = {
    1: 3, 2: 8, 3: 3, 4: 16, 6: 8, 8: 36, 12: 10, 16: 36, 24: 8, 32: 28, 48: 6,
    64: 28, 96: 4, 128: 16, 256: 10, 512: 6, 1024: 5,
}


def _random_config(rng: random.Random, w: int) -> Config:
    tp = rng.choice(_divisors(w, 8))
    pp = rng.choice(_divisors(w // tp, 8))
    cp = rng.choice(_divisors(w // (tp * pp), 8)) if rng.random() < 0.5 else 1
    dp = w // (tp * pp * cp)
    etp = rng.choice(_divisors(w // pp, 8)) if rng.random() < 0.4 else None
    ep = rng.choice(_divisors(w // (pp * (etp or tp)), 16)) if rng.random() < 0.6 else 1
    edp = w // (pp * ep * (etp or tp))
    kw: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
        "create_gloo_process_groups": False,
    }
    if etp is not None:
        kw["expert_tensor_parallel_size"] = etp
    # order: common ones, any permutation, tokens of size 1 sometimes left out, case
    r = rng.random()
    order = rng.choice(COMMON_ORDERS) if r < 0.55 else rng.choice(ALL_ORDERS)
    size_one = {
        "tp": tp == 1 and (etp or tp) == 1,
        "cp": cp == 1,
        "ep": ep == 1,
        "dp": dp == 1 and edp == 1,
        "pp": pp == 1,
    }
    tokens = order.split("-")
    if rng.random() < 0.3:
        tokens = [t for t in tokens if not (size_one.get(t) and rng.random() < 0.6)] or tokens
    if rng.random() < 0.03:  # drop a token whose size is > 1: invalid
        big = [t for t in tokens if not size_one.get(t, True)]
        if big:
            tokens.remove(rng.choice(big))
    order = "-".join(tokens)
    if rng.random() < 0.05:
        order = order.upper()
    if order != "tp-cp-ep-dp-pp" or rng.random() < 0.2:
        kw["order"] = order
    if pp > 1 and rng.random() < 0.35:
        kw["virtual_pipeline_model_parallel_size"] = rng.choice([1, 2, 3, 4])
    elif pp == 1 and rng.random() < 0.03:
        kw["virtual_pipeline_model_parallel_size"] = 2  # invalid
    if cp > 1 and rng.random() < 0.4:
        factors = [f for f in _divisors(cp) if 1 < f < cp]
        if factors and rng.random() < 0.7:
            a = rng.choice(factors)
            kw["hierarchical_context_parallel_sizes"] = [a, cp // a]
        else:
            kw["hierarchical_context_parallel_sizes"] = [cp]
        if rng.random() < 0.08:
            kw["hierarchical_context_parallel_sizes"] = [cp, 2]  # product != cp: invalid
    if rng.random() < 0.08 and w <= 256:
        kw["hybrid_context_parallel"] = True
    if rng.random() < 0.18:
        common = [d for d in _divisors(math.gcd(dp * cp, edp)) if d > 1]
        if common:
            kw["num_distributed_optimizer_instances"] = rng.choice(common)
        elif rng.random() < 0.3:
            kw["num_distributed_optimizer_instances"] = 3 if (dp * cp) % 3 else 5
    if rng.random() < 0.1:
        kw["distributed_timeout_minutes"] = rng.choice([5, 120])
    if rng.random() < 0.15:
        kw["create_all_gather_group"] = True
    if rng.random() < 0.1:
        kw["get_embedding_ranks"] = EMBEDDING_CALLABLES[rng.choice(["last", "all", "even", "middle", "first_and_second"])]
    if rng.random() < 0.08:
        kw["get_position_embedding_ranks"] = EMBEDDING_CALLABLES[rng.choice(["last", "all", "even", "middle"])]
    if rng.random() < 0.04:
        kw["pipeline_model_parallel_comm_backend"] = rng.choice(["nccl", "ucc", "nccl"])
    if rng.random() < 0.05:
        kw["high_priority_stream_groups"] = rng.choice([["zz"], [], ["tp"], ["dp_cp", "ep_dp"]])
    return Config(w, kw)


def _hand_written() -> list[Config]:
    """Edge cases and every invalid configuration class, written out."""
    base = {"create_gloo_process_groups": False}

    def c(w, tag="", env=None, cuda_stub=False, yaml=None, **kw):
        return Config(w, {**base, **kw}, env=env or {}, cuda_stub=cuda_stub, yaml=yaml, tag=tag)

    cfgs = [
        # defaults and big worlds
        c(1), c(2), c(8), c(1024), c(1024, tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                                     context_parallel_size=2, expert_model_parallel_size=16),
        c(1024, tensor_model_parallel_size=4, pipeline_model_parallel_size=4, expert_model_parallel_size=8,
          expert_tensor_parallel_size=1, num_distributed_optimizer_instances=4, order="tp-cp-ep-dp-pp"),
        c(512, tensor_model_parallel_size=2, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
          virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_size=4),
        c(256, context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2, 2], tensor_model_parallel_size=2),
        # hierarchical CP: empty list (falsy: ignored), [1] with cp 1, three levels
        c(8, hierarchical_context_parallel_sizes=[]),
        c(8, hierarchical_context_parallel_sizes=[1]),
        c(16, context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2, 2]),
        c(16, context_parallel_size=4, hierarchical_context_parallel_sizes=[4, 1]),
        # hybrid CP with DPxCP sizes that are not powers of two, and odd (invalid)
        c(6, hybrid_context_parallel=True), c(10, hybrid_context_parallel=True),
        c(12, context_parallel_size=2, hybrid_context_parallel=True),
        c(20, tensor_model_parallel_size=2, hybrid_context_parallel=True),
        c(2, hybrid_context_parallel=True), c(3, hybrid_context_parallel=True), c(1, hybrid_context_parallel=True),
        c(32, context_parallel_size=4, hybrid_context_parallel=True, num_distributed_optimizer_instances=2),
        # virtual pipeline
        c(8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1),
        c(8, pipeline_model_parallel_size=8, virtual_pipeline_model_parallel_size=4),
        c(8, virtual_pipeline_model_parallel_size=2),  # invalid: pp 1
        # embedding callables, including an empty embedding group (invalid on torch)
        *[c(8, pipeline_model_parallel_size=4, get_embedding_ranks=f) for f in EMBEDDING_CALLABLES.values()],
        *[c(8, pipeline_model_parallel_size=4, get_position_embedding_ranks=f) for f in EMBEDDING_CALLABLES.values()],
        c(16, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
          get_embedding_ranks=emb_middle, get_position_embedding_ranks=emb_last),
        c(16, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, get_embedding_ranks=emb_all),
        # orders MCore accepts or rejects
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="TP-DP-PP"),
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-cp-ep-dp-pp-pp"),
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-tp-dp-pp"),
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-xx-dp-pp"),
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp - dp-pp"),
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp_dp_pp"),
        c(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="dp"),
        c(8, order=""), c(1, order=""), c(1, order="dp"), c(8, order="dp"),
        c(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=4,
          expert_tensor_parallel_size=1, order="tp-cp-ep-pp-dp"),  # pp not last, edp != dp
        c(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
          order="tp-cp-ep-pp-dp"),  # pp not last, edp == dp
        # indivisible worlds and bad sizes
        c(8, tensor_model_parallel_size=3), c(12, pipeline_model_parallel_size=8),
        c(8, expert_tensor_parallel_size=3), c(8, expert_model_parallel_size=3),
        c(8, tensor_model_parallel_size=16), c(8, tensor_model_parallel_size=0),
        c(16, expert_model_parallel_size=2, context_parallel_size=2),
        # distributed optimizer instances
        c(8, num_distributed_optimizer_instances=3), c(8, num_distributed_optimizer_instances=0),
        c(8, num_distributed_optimizer_instances=8), c(8, expert_model_parallel_size=8, num_distributed_optimizer_instances=2),
        c(16, expert_model_parallel_size=4, expert_tensor_parallel_size=2, num_distributed_optimizer_instances=2),
        # hierarchical sizes whose product is not cp
        c(16, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3]),
        c(16, context_parallel_size=4, hierarchical_context_parallel_sizes=[8]),
        # SHARP: on a CPU build MCore's barrier needs torch.cuda; with the stub it runs
        c(8, use_sharp=True), c(8, use_sharp=True, cuda_stub=True),
        c(8, use_sharp=True, sharp_enabled_group="dp", cuda_stub=True),
        c(16, use_sharp=True, sharp_enabled_group="dp_replica", num_distributed_optimizer_instances=2),
        c(16, use_sharp=True, sharp_enabled_group="dp_replica", num_distributed_optimizer_instances=2, cuda_stub=True),
        c(16, use_sharp=True, sharp_enabled_group="dp_replica", num_distributed_optimizer_instances=4,
          expert_model_parallel_size=2, cuda_stub=True),
        c(8, use_sharp=True, sharp_enabled_group="dp_replica"),  # invalid: needs dopt > 1
        c(8, use_sharp=True, sharp_enabled_group="tp"),  # invalid: unknown group
        c(8, sharp_enabled_group="dp"),  # invalid: without use_sharp
        c(8, cuda_stub=True, env={"NCCL_COLLNET_ENABLE": "1"}),  # MCore clears it at init
        # pipeline communication backend
        c(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="nccl"),
        c(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="ucc"),
        c(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="ucc",
          env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
        c(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="ucc",
          env={"CUDA_DEVICE_MAX_CONNECTIONS": "8", "UCX_TLS": "tcp"}),
        c(8, pipeline_model_parallel_size=2, pipeline_model_parallel_comm_backend="gloo"),
        c(8, pipeline_model_parallel_comm_backend="bogus"),
        # NCCL communicator configs and high-priority streams
        c(8, yaml="other"), c(8, yaml="tp"), c(8, yaml="empty"), c(8, yaml="absent"),
        c(8, yaml="other", high_priority_stream_groups=["zz"]),
        c(8, high_priority_stream_groups=["dp_cp"]), c(8, high_priority_stream_groups=[]),
        # timeouts, all-gather group, gloo on the fake backend
        c(8, distributed_timeout_minutes=1, create_all_gather_group=True, context_parallel_size=2),
        c(8, distributed_timeout_minutes=0), c(16, hybrid_context_parallel=True, distributed_timeout_minutes=7),
        Config(8, {"tensor_model_parallel_size": 2}, tag="default-gloo"),
        c(8, create_all_gather_group=None),
    ]
    return cfgs


def all_configs() -> list[Config]:
    """Hand-written configurations, then seeded random ones; ids are unique."""
    rng = random.Random(3)
    configs: dict[str, Config] = {}
    for cfg in _hand_written():
        configs.setdefault(cfg.id, cfg)
    for w, count in WORLD_PLAN.items():
        made = attempts = 0
        while made < count and attempts < 50 * count:
            attempts += 1
            cfg = _random_config(rng, w)
            if cfg.id not in configs:
                configs[cfg.id] = cfg
                made += 1
    return list(configs.values())


CONFIGS = all_configs()

# --------------------------------------------------------------------------- running


def _kwargs(cfg: Config, tmp_path) -> dict[str, Any]:
    kw = dict(cfg.kwargs)
    if cfg.yaml is not None:
        path = tmp_path / f"nccl_{cfg.yaml}.yaml"
        if YAMLS[cfg.yaml] is not None:
            path.write_text(YAMLS[cfg.yaml])
        kw["nccl_communicator_config_path"] = str(path)
    return kw


def run_side(ps: Any, cfg: Config, rank: int, tmp_path, **options) -> D.Observation:
    """Fresh fake world of ``cfg.world`` ranks as ``rank``; observe one init of ``ps``."""
    D.fake_world(rank, cfg.world)
    return D.observe(ps, rank, _kwargs(cfg, tmp_path), env=cfg.env, cuda_stub=cfg.cuda_stub, **options)


@dataclass
class Tally:
    """What this process compared (printed by the summary test)."""

    configs: int = 0
    runs: int = 0  # configuration x rank pairs
    valid_runs: int = 0
    mismatches: list[str] = field(default_factory=list)
    mcore_leftovers: dict[str, set] = field(default_factory=dict)  # exception -> globals left set
    env_on_failure: dict[str, tuple] = field(default_factory=dict)


TALLY = Tally()


@pytest.fixture(autouse=True)
def _no_world_left():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def compat_ps():
    """``compat.parallel_state``; skipped only while the module does not exist yet."""
    return pytest.importorskip("compat.parallel_state")


def _left_set(state: dict[str, Any]) -> set:
    return {k[len("global:"):] for k, v in state.items() if k.startswith("global:") and v not in (None, ("dict", ()))}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_compat_matches_mcore(cfg: Config, compat_ps, tmp_path):
    """Every observable of compat equals MCore's, for each compared rank of ``cfg``."""
    TALLY.configs += 1
    failures = []
    for rank in cfg.ranks():
        ref = run_side(mcore_ps, cfg, rank, tmp_path)
        got = run_side(compat_ps, cfg, rank, tmp_path, snapshot_before=True)
        TALLY.runs += 1
        if D.equivalent(ref.outcome, got.outcome):
            diffs = D.compare(ref.comparable(), got.comparable())
        else:  # one side raised (or raised another type): the outcome is the difference
            diffs = [D.Difference("init:outcome", ref.outcome, got.outcome)]
        if ref.outcome != "ok":
            exc = ref.outcome[1]
            TALLY.mcore_leftovers.setdefault(exc, set()).update(_left_set(ref.state))
            if ref.env:
                TALLY.env_on_failure[cfg.id] = (ref.env, got.env)
            if got.outcome != "ok":  # compat failed too: it must not have changed its state
                atomic = D.compare(got.before, got.state)
                if atomic:
                    failures.append(f"rank {rank}: compat is not atomic after {got.error_message!r}:\n"
                                    + D.describe(atomic))
        else:
            TALLY.valid_runs += 1
        if diffs:
            failures.append(
                f"rank {rank} (MCore: {ref.error_message or 'ok'}; compat: {got.error_message or 'ok'}):\n"
                + D.describe(diffs)
            )
    if failures:
        TALLY.mismatches.append(cfg.id)
        pytest.fail(f"{cfg.id}\n" + "\n\n".join(failures), pytrace=False)


def test_summary_of_differential():
    """Prints 'configurations x ranks compared, mismatches' for this process."""
    if TALLY.runs == 0:
        pytest.skip("no differential configuration ran in this process (xdist worker or compat missing)")
    print(
        f"\ndifferential: {TALLY.configs} configurations, {TALLY.runs} configuration x rank runs compared "
        f"({TALLY.valid_runs} valid inits), mismatching configurations: {len(TALLY.mismatches)}"
    )
    for exc, names in sorted(TALLY.mcore_leftovers.items()):
        print(f"  MCore after a failed init ({exc}) leaves set: {sorted(names) or 'nothing'}")
    for cid, (ref_env, got_env) in sorted(TALLY.env_on_failure.items()):
        print(f"  env after failed init {cid}: MCore {ref_env}, compat {got_env}")
    assert TALLY.configs >= 1 and TALLY.runs >= TALLY.configs
    assert not TALLY.mismatches, f"mismatching configurations: {TALLY.mismatches}"
