"""Configurations for the differential test, for whichever release is the reference.

A :class:`Config` is one ``initialize_model_parallel`` call on a fake world (plus, on 0.18+,
calls made after it such as ``create_all_gather_groups``). Everything here follows the
*reference* ``megatron.core.parallel_state`` of this process (:func:`applies`). The plan of
hand-written and seeded random cases is :mod:`tests.support.differential.plans`, the
release-specific families :mod:`tests.support.differential.release_configs`; running and
comparing them is :mod:`tests.support.differential.run`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import itertools
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import megatron.core.parallel_state as mcore_ps

from parallel_state_ng.releases import Release, parse_release
from tests.support import torch_at_hand
from tests.support.differential import legacy_layout
from tests.support.differential import library as D

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
    """One ``initialize_model_parallel`` call on a fake world of ``world`` ranks.

    It follows the reference: the installed Megatron-Core, or the release
    :func:`tests.support.releases.binding.activate` bound the process to. A configuration only
    uses parameters the reference's ``initialize_model_parallel`` has; the sampler draws GTP
    sizes only where the reference has ``gtp_remat_size``, a sub-world only where it has
    ``rank_offset`` and ``local_world_size``, the all-gather groups after init only where it has
    ``create_all_gather_groups``, and an encoder block or a pipeline split rank only where it
    has the 0.12/0.13 encoder sizes and ``pipeline_model_parallel_split_rank``. A parameter of
    the reference this module does not know raises :class:`library.UnknownApiError` (a new
    argument is never silently left at its default).
    """

    world: int
    kwargs: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    cuda_stub: bool = False
    yaml: str | None = None  # key of YAMLS: written to tmp_path, passed as the config path
    tag: str = ""  # extra id text for hand-written configs
    invalid: bool = False  # MCore is known to reject it (with the torch at hand: see needs_gpu)
    invalid_since: str | None = None  # ... from this release series on (e.g. "0.19")
    # MCore rejects it only for want of NCCL and a GPU (an NCCL group, torch.cuda calls): with a
    # torch that has both (tests/support/torch_at_hand.py) it is valid, unless invalid_since says
    # otherwise for the release.
    needs_gpu: bool = False
    # MCore rejects it on a simulated world where a fake-backend group cannot take NCCL options
    # (tests/support/torch_at_hand.py: a CPU build, or the fake backend of a newer torch).
    needs_nccl_options: bool = False
    hand_written: bool = False  # then ``invalid`` is checked against MCore
    # A documented deliberate difference (docs/differences.md): "rejects" — MCore
    # accepts it but compat refuses with a ValueError naming ``deliberate_arg``; "barrier-once"
    # — compat runs the SHARP dp_replica barrier once where MCore repeats it.
    deliberate: str | None = None
    deliberate_arg: str = ""
    after_init: tuple = ()  # differential.Call's made after a good init (0.18+ all-gather groups)

    @property
    def expected_invalid(self) -> bool:
        """Whether the reference release, with the torch at hand, is known to reject this configuration."""
        if self.invalid_since is not None and reference_release().at_least(self.invalid_since):
            return True
        if self.needs_gpu:
            return not torch_at_hand.nccl_usable()
        if self.needs_nccl_options:
            return not torch_at_hand.fake_group_takes_nccl_options()
        return self.invalid

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
        for name, short in legacy_layout.ID_PARTS:  # 0.12/0.13: encoder sizes, split rank
            if name in k:
                parts.append(f"{short}{k[name]}")
        for name, short in (
            ("gtp_remat_size", "gtp"),
            ("expert_gtp_remat_size", "egtp"),
            ("rank_offset", "off"),
            ("local_world_size", "lws"),
        ):
            if name in k:
                parts.append(f"{short}{k[name]}")
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
        for call in self.after_init:
            parts.append("then_" + call.key.replace(" ", ""))
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
        ranks = [0, w - 1] + sorted(middle)
        offset, local = self.kwargs.get("rank_offset"), self.kwargs.get("local_world_size")
        if isinstance(offset, int) and isinstance(local, int):  # both edges of the sub-world
            ranks += [r for r in (offset, offset + local - 1) if 0 <= r < w and r not in ranks]
        if legacy_layout.ENC_PP in self.kwargs:  # 0.12/0.13: where the encoder and decoder blocks meet
            ranks += [r for r in legacy_layout.boundary_ranks(self) if r not in ranks]
        return ranks


def _divisors(n: int, limit: int = 1 << 30) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d <= limit]


TOKENS = ("tp", "cp", "ep", "dp", "pp")
COMMON_ORDERS = ("tp-cp-ep-dp-pp", "tp-dp-pp", "tp-pp-dp", "tp-cp-ep-pp-dp", "tp-ep-cp-dp-pp", "cp-tp-ep-dp-pp")
ALL_ORDERS = ["-".join(p) for p in itertools.permutations(TOKENS)]

# world size -> number of random configurations
WORLD_PLAN = {
    1: 3,
    2: 8,
    3: 3,
    4: 16,
    6: 8,
    8: 36,
    12: 10,
    16: 36,
    24: 8,
    32: 28,
    48: 6,
    64: 28,
    96: 4,
    128: 16,
    256: 10,
    512: 6,
    1024: 5,
}


@functools.cache
def init_parameters() -> tuple[str, ...]:
    """Parameter names of the reference's ``initialize_model_parallel``, in order.

    Raises:
        library.UnknownApiError: a parameter this module does not know how to vary.
    """
    names = tuple(inspect.signature(mcore_ps.initialize_model_parallel).parameters)
    unknown = [n for n in names if n not in KNOWN_INIT_PARAMETERS]
    if unknown:
        raise D.UnknownApiError(
            f"initialize_model_parallel has parameters {unknown} the configuration sampler does not know: "
            "teach tests/support/differential/configs.py"
        )
    return names


# Every initialize_model_parallel parameter of a supported release; the sampler or the
# hand-written list varies each one the reference has.
KNOWN_INIT_PARAMETERS = frozenset(
    {
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "pipeline_model_parallel_comm_backend",
        "use_sharp",
        "context_parallel_size",
        "hierarchical_context_parallel_sizes",
        "hybrid_context_parallel",
        "expert_model_parallel_size",
        "gtp_remat_size",
        "expert_gtp_remat_size",
        "num_distributed_optimizer_instances",
        "expert_tensor_parallel_size",
        "nccl_communicator_config_path",
        "distributed_timeout_minutes",
        "order",
        "get_embedding_ranks",
        "get_position_embedding_ranks",
        "create_gloo_process_groups",
        "high_priority_stream_groups",
        "sharp_enabled_group",
        "create_all_gather_group",
        "rank_offset",
        "local_world_size",
        # 0.12/0.13 (tests/support/differential/release_configs.py)
        "pipeline_model_parallel_split_rank",
        "encoder_tensor_model_parallel_size",
        "encoder_pipeline_model_parallel_size",
    }
)


@functools.cache
def reference_release() -> Release:
    """The reference's release (the megatron-core distribution this process sees)."""
    return parse_release(importlib.metadata.version("megatron-core"))


def has(parameter: str) -> bool:
    """Whether the reference's ``initialize_model_parallel`` takes ``parameter``."""
    return parameter in init_parameters()


def has_function(name: str) -> bool:
    """Whether the reference ``parallel_state`` has the public function ``name``."""
    return name in D.reference_functions()


def applies(cfg: Config) -> bool:
    """Whether the reference has every parameter and after-init function ``cfg`` uses."""
    return all(has(k) for k in cfg.kwargs) and all(has_function(c.name) for c in cfg.after_init)
