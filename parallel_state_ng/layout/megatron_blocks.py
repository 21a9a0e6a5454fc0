"""The block layouts of :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`, as data.

A Megatron layout is up to four named-dim blocks over its ranks: the 0.12/0.13 encoder block
first, then the decoder's dense and expert blocks over the same ranks, and the split views of
the optimizer instances over them. :data:`BLOCKS` states the dense and expert blocks: the size
arguments whose product divides the world (in the order MCore names them), the argument that
receives their quotient (the block's data-parallel size), each order token's size argument and
where 0.19's GTP axis goes. :data:`SPLITS` states the optimizer-instance splits: the dims
re-expressed and the names of their two parts. Functions read the sizes off a layout by name.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from parallel_state_ng.layout.named_layout import Layout
from parallel_state_ng.layout.order import GTP_TOKEN, quotient, read_order

__all__ = ["Block", "BLOCKS", "SPLITS", "block_data_parallel_size", "block_layout", "split_blocks"]


class Block(NamedTuple):
    """One block generated from ``order``: where its sizes come from."""

    #: size arguments dividing the block's ranks, in the order the error message names them
    divisors: tuple[str, ...]
    #: the argument set to the quotient (the block's data-parallel size)
    data_parallel: str
    #: order token -> its size argument (``None``: size 1), in the order MCore's generator lists them
    tokens: dict[str, str | None]
    #: the GTP size argument (0.19): a divisor and the size of the ``gtp_remat`` token
    gtp: str
    #: the token 0.19 places the GTP axis after
    gtp_after: str


#: The dense (decoder) and expert blocks, both over the ranks after the encoder block.
BLOCKS: dict[str, Block] = {
    "decoder": Block(
        divisors=("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
        data_parallel="data_parallel_size",
        tokens={
            "tp": "tensor_model_parallel_size",
            "pp": "pipeline_model_parallel_size",
            "dp": "data_parallel_size",
            "ep": None,
            "cp": "context_parallel_size",
        },
        gtp="gtp_remat_size",
        gtp_after="tp",
    ),
    "expert": Block(
        divisors=("expert_tensor_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size"),
        data_parallel="expert_data_parallel_size",
        tokens={
            "tp": "expert_tensor_parallel_size",
            "pp": "pipeline_model_parallel_size",
            "dp": "expert_data_parallel_size",
            "ep": "expert_model_parallel_size",
            "cp": None,
        },
        gtp="expert_gtp_remat_size",
        gtp_after="ep",
    ),
}

#: The optimizer instances' splits: name -> (dims split, the parts' names: within one instance,
#: across instances). The part sizes are (size / instances, instances).
SPLITS: dict[str, tuple[list[str], list[str]]] = {
    "_intra_dp_cp": (["cp", "dp"], ["intra_dp_cp", "inter_dp_cp"]),
    "_edp_split": (["dp"], ["intra_ep_dp", "inter_ep_dp"]),
}


def block_data_parallel_size(layout: Any, name: str, ranks: int, what: str, gtp_axis: bool) -> int:
    """``ranks`` divided by block ``name``'s size arguments of ``layout`` (``RuntimeError`` if not)."""
    block = BLOCKS[name]
    divisors = (*block.divisors, block.gtp) if gtp_axis else block.divisors
    return quotient(ranks, what, **{arg: getattr(layout, arg) for arg in divisors})


def block_layout(layout: Any, name: str, start: int, gtp_axis: bool) -> Layout:
    """Block ``name`` of ``layout`` from rank ``start``, its dims in ``layout.order`` as the release reads it."""
    block = BLOCKS[name]
    sizes = {token: 1 if arg is None else getattr(layout, arg) for token, arg in block.tokens.items()}
    if gtp_axis:
        sizes[GTP_TOKEN] = getattr(layout, block.gtp)
    tokens = read_order(layout.order, sizes, block.gtp_after if gtp_axis else None)
    return Layout([sizes[t] for t in tokens], tokens, start)


def split_blocks(blocks: dict[str, Layout], split: str, size: int, instances: int) -> dict[str, Layout]:
    """Each of ``blocks`` with the dims of ``split`` (size ``size``) re-expressed per optimizer instance."""
    dims, parts = SPLITS[split]
    return {name: block.split(dims, [size // instances, instances], parts) for name, block in blocks.items()}
