"""0.12/0.13's encoder block and pipeline split rank: the argument names and MCore's arithmetic.

Shared by :mod:`tests.support.differential.configs` (configuration ids and compared ranks) and
:mod:`tests.support.differential.release_configs` (the legacy configuration families). A
configuration here is anything with ``kwargs`` and ``world``
(:class:`tests.support.differential.configs.Config`).
"""

from __future__ import annotations

from typing import Any

ENC_TP = "encoder_tensor_model_parallel_size"
ENC_PP = "encoder_pipeline_model_parallel_size"
SPLIT = "pipeline_model_parallel_split_rank"  # also moves the default (position-)embedding ranks
# id text of each legacy argument (``Config.id``)
ID_PARTS = ((ENC_TP, "enctp"), (ENC_PP, "encpp"), (SPLIT, "split"))


def encoder_block(kwargs: dict[str, Any], world: int) -> tuple[int, int] | None:
    """``(encoder world size, data-parallel size)`` as MCore derives them, when ``kwargs`` has an
    encoder block (encoder pp > 0) in a world it divides; else ``None``.

    With an encoder (encoder tp 0 means "= tp"; encoder pp ``None`` means 0) the world is an
    encoder block ``[0, enc_world)`` followed by the decoder block; the world must be divisible
    by ``(enc_tp * enc_pp + tp * pp) * cp``, ``dp = world // that``, ``enc_tp <= tp``; the
    expert layout covers the decoder block only (``edp = decoder_world // (etp * ep * pp)``).
    """
    enc_pp = kwargs.get(ENC_PP) or 0
    sizes = [
        kwargs.get(n, 1)
        for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    ]
    enc_tp = kwargs.get(ENC_TP, 0)
    if not all(type(v) is int for v in (enc_pp, enc_tp, *sizes)) or enc_pp <= 0:
        return None
    tp, pp, cp = sizes
    enc_tp = enc_tp or tp
    total = (enc_tp * enc_pp + tp * pp) * cp
    if total <= 0 or world % total:
        return None
    dp = world // total
    return enc_tp * enc_pp * cp * dp, dp


def has_encoder(cfg: Any) -> bool:
    """Whether the configuration asks for an encoder block (encoder pp > 0)."""
    value = cfg.kwargs.get(ENC_PP)
    return type(value) is int and value > 0


def has_split_rank(cfg: Any) -> bool:
    """Whether the configuration passes a pipeline split rank."""
    return cfg.kwargs.get(SPLIT) is not None


def boundary_ranks(cfg: Any) -> list[int]:
    """The last encoder rank and the first decoder rank (where the blocks meet)."""
    block = encoder_block(cfg.kwargs, cfg.world)
    if block is None:
        return []
    enc_world = block[0]
    return [r for r in (enc_world - 1, enc_world) if 0 <= r < cfg.world]
