"""Inference shard specs as data: ``"tp=2,dp=1+tp=1,dp=2"``, dicts or specs -> a validated list.

Megatron 0.19 parses shard specs in ``megatron.core.inference.shards_spec``;
:mod:`parallel_state_ng.builders.inference` uses that parser whenever the release has it, so that
specs and errors are Megatron's own. This module is the stand-in for every other case (no
megatron-core, or a release before 0.19): the same spec language and the same exception types
(``AssertionError`` for the syntax, an unknown key or role and a partition that does not cover
the world; ``ValueError`` for a shard that cannot be laid out), checked against Megatron's
parser by ``tests/releases/test_inference_releases.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parallel_state_ng.releases.inference_shards import SPEC_ROLES, SPEC_SIZE_KEYS

__all__ = ["ShardSpec", "parse_shard_specs"]


@dataclass(frozen=True)
class ShardSpec:
    """One inference shard: its sizes and, for prefill/decode disaggregation, its ``role``.

    ``expt_tp`` defaults to ``tp``. The shard holds ``tp * pp * dp`` ranks (:attr:`world_size`).

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is < 1, ``role`` is not ``"prefill"``, ``"decode"`` or ``None``,
            ``cp`` is not 1 (inference shards have no context parallelism), or
            ``expt_tp * ep * pp`` does not divide the shard's ranks.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1
    expt_tp: int | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in SPEC_ROLES:
            raise ValueError(f"shard role must be one of {SPEC_ROLES} or None, got role={self.role!r}")
        if self.expt_tp is None:
            object.__setattr__(self, "expt_tp", self.tp)
        for key in SPEC_SIZE_KEYS:
            value = getattr(self, key)
            if type(value) is not int:
                raise TypeError(f"shard size {key} must be an int, got {key}={value!r}")
            if value < 1:
                raise ValueError(f"shard size {key} must be >= 1, got {key}={value}")
        if self.cp != 1:
            raise ValueError(f"inference shards have no context parallelism: cp must be 1, got cp={self.cp}")
        expert = self.expert_ranks_per_replica
        if self.world_size % expert:
            raise ValueError(
                f"shard {self}: expt_tp*ep*pp = {self.expt_tp}*{self.ep}*{self.pp} = {expert} does not "
                f"divide its tp*pp*dp = {self.world_size} ranks"
            )

    @property
    def world_size(self) -> int:
        """How many ranks the shard holds: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @property
    def expert_ranks_per_replica(self) -> int:
        """``expt_tp * ep * pp``: the ranks one copy of the expert layers spans."""
        assert self.expt_tp is not None  # set in __post_init__
        return self.expt_tp * self.ep * self.pp


def _parse_one(text: str) -> ShardSpec:
    """One shard's ``key=value,key=value`` text."""
    fields: dict[str, Any] = {}
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if "=" not in entry:
            raise AssertionError(f"shard spec entry {entry!r} in {text!r} is not key=value")
        key, value = (side.strip() for side in entry.split("=", 1))
        if key == "role":
            if value.lower() not in SPEC_ROLES:
                raise AssertionError(f"shard spec {text!r}: role must be one of {SPEC_ROLES}, got {value!r}")
            fields[key] = value.lower()
        elif key in SPEC_SIZE_KEYS:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"shard spec {text!r}: {key} must be an integer, got {value!r}") from None
        else:
            raise AssertionError(
                f"shard spec {text!r}: unknown key {key!r} (keys: {', '.join((*SPEC_SIZE_KEYS, 'role'))})"
            )
    return ShardSpec(**fields)


def parse_shard_specs(shards: str | Sequence[Any], total_world_size: int) -> list[ShardSpec]:
    """The shards of ``shards``, validated, in rank order (the first shard starts at rank 0).

    ``shards`` is a spec string (shards separated by ``;`` or ``+``, each ``key=value`` pairs
    separated by ``,``; keys ``tp pp ep expt_tp dp cp role``), or a sequence of
    :class:`ShardSpec` and dicts of the same keys. The shards must use exactly
    ``total_world_size`` ranks together.

    Raises:
        AssertionError: a syntax error, an unknown key or role, no shard, or shards that use
            another number of ranks than ``total_world_size``.
        ValueError, TypeError: a shard that cannot be laid out (see :class:`ShardSpec`), or a
            size that is not an integer.
    """
    if isinstance(shards, str):
        specs = [_parse_one(text.strip()) for text in shards.replace("+", ";").split(";") if text.strip()]
    elif isinstance(shards, Sequence):
        specs = [s if isinstance(s, ShardSpec) else ShardSpec(**_as_mapping(s)) for s in shards]
    else:
        raise TypeError(f"shards must be a spec string or a sequence of specs or dicts, got {shards!r}")
    assert specs, f"no shard in the shard spec {shards!r}"
    used = sum(spec.world_size for spec in specs)
    assert used == total_world_size, (
        f"the shards use {used} ranks ({' + '.join(str(s.world_size) for s in specs)}) but "
        f"total_world_size is {total_world_size}: the shards must cover every rank exactly once"
    )
    return specs


def _as_mapping(item: Any) -> Mapping[str, Any]:
    """A shard given as a dict (or pairs), as keyword arguments of :class:`ShardSpec`."""
    try:
        return dict(item)
    except (TypeError, ValueError):
        keys = (*SPEC_SIZE_KEYS, "role")
        raise TypeError(f"a shard must be a ShardSpec or a dict of the keys {keys}, got {item!r}") from None
