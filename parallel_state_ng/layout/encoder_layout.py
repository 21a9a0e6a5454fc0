"""How megatron-core 0.12/0.13 joins an encoder block to the decoder's groups (pure math).

:class:`EncoderBlock` states the rules (the encoder on the first ranks, stitched pipelines,
concatenated model-parallel groups) and answers them for one rank in O(group size), or
enumerates them in MCore's order. No ``torch.distributed``. See docs/releases.md
("The encoder/decoder era").
"""

from __future__ import annotations

from parallel_state_ng.layout.named_layout import Layout

__all__ = ["EncoderBlock", "resolve_encoder_sizes", "encoder_data_parallel_size"]

_PP = ("pp",)


class EncoderBlock:
    """The encoder layout of a 0.12/0.13 configuration and how its groups join the decoder's.

    The encoder has the first ranks and a rank generator of its own (expert size 1, the
    decoder's order, data- and context-parallel sizes); the decoder and expert generators
    start after it. Pipeline groups are stitched: with ``D`` decoder and ``E`` encoder
    pipelines (``D >= E``), encoder pipeline ``j`` precedes ``D // E`` decoder ones, one more
    for the first ``D % E``, so an encoder rank is in several. Model-parallel (tp × pp) groups
    are concatenated (encoder group ``i`` + decoder group ``i``); every other kind lists the
    encoder's groups, then the decoder's (or expert's).

    Args:
        encoder: the encoder's layout (ranks ``[0, encoder world)``).
        decoder: the decoder's dense layout (offset by the encoder world).
        expert: the decoder's expert layout (same offset).
    """

    def __init__(self, encoder: Layout, decoder: Layout, expert: Layout) -> None:
        self.encoder, self.decoder, self.expert = encoder, decoder, expert
        self._rep, self._remain = divmod(decoder.num_groups(_PP), encoder.num_groups(_PP))

    def contains(self, rank: int) -> bool:
        """Whether ``rank`` is an encoder rank."""
        return self.encoder.contains(rank)

    # ------------------------------------------------------------------ pipelines
    def _first_decoder_pipeline(self, j: int) -> int:
        return j * self._rep + min(j, self._remain)

    def _encoder_pipeline_of(self, i: int) -> int:
        """The encoder pipeline that precedes decoder pipeline ``i``."""
        big = self._remain * (self._rep + 1)  # decoder pipelines owned by the first D % E encoder ones
        if i < big:
            return i // (self._rep + 1)
        return self._remain + (i - big) // self._rep

    def pipelines(self, rank: int) -> list[list[int]]:
        """Every stitched pipeline group of ``rank``, in MCore's order (one for a decoder rank)."""
        if self.encoder.contains(rank):
            j = self.encoder.group_index(rank, _PP)
            head = self.encoder.group_ranks(rank, _PP)
            first = self._first_decoder_pipeline(j)
            count = self._rep + (1 if j < self._remain else 0)
            return [head + self.decoder.group_at(i, _PP) for i in range(first, first + count)]
        i = self.decoder.group_index(rank, _PP)
        return [self.encoder.group_at(self._encoder_pipeline_of(i), _PP) + self.decoder.group_ranks(rank, _PP)]

    def all_pipelines(self) -> list[list[int]]:
        """Every stitched pipeline group, in MCore's order (O(world size); tools and tests)."""
        encoder = self.encoder.rank_enum(_PP)
        return [encoder[self._encoder_pipeline_of(i)] + d for i, d in enumerate(self.decoder.rank_enum(_PP))]

    # ------------------------------------------------------------ other kinds
    def concatenated(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """``rank``'s model-parallel group: encoder group ``i`` + decoder group ``i``."""
        own = self.encoder if self.encoder.contains(rank) else self.decoder
        i = own.group_index(rank, dims)
        return self.encoder.group_at(i, dims) + self.decoder.group_at(i, dims)

    def all_concatenated(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every model-parallel group (O(world size))."""
        return [e + d for e, d in zip(self.encoder.rank_enum(dims), self.decoder.rank_enum(dims), strict=False)]

    def chunk(self, rank: int, dims: tuple[str, ...], size: int) -> list[int] | None:
        """``rank``'s chunk of ``size`` consecutive groups over ``dims`` (encoder's, then expert's).

        MCore 0.13 builds the distributed-optimizer instance groups by walking the tp-ep-pp
        groups of both blocks and cutting a group after every ``size`` of them; groups left
        over at the end form no chunk (``None``). O(chunk size).
        """
        n_encoder = self.encoder.num_groups(dims)
        total = n_encoder + self.expert.num_groups(dims)
        if self.encoder.contains(rank):
            g = self.encoder.group_index(rank, dims)
        else:
            g = n_encoder + self.expert.group_index(rank, dims)
        start = (g // size) * size
        if start + size > total:
            return None
        out: list[int] = []
        for index in range(start, start + size):
            if index < n_encoder:
                out += self.encoder.group_at(index, dims)
            else:
                out += self.expert.group_at(index - n_encoder, dims)
        return out


def resolve_encoder_sizes(encoder_tp: int, encoder_pp: int | None, tensor_model_parallel_size: int) -> tuple[int, int]:
    """The encoder's ``(tensor, pipeline)`` sizes as MCore 0.12/0.13 reads its arguments.

    ``encoder_pp`` ``None`` means 0 (no encoder); an encoder tensor size of 0 with an encoder
    pipeline means the decoder's. An encoder tensor size above the decoder's raises
    ``AssertionError`` (as MCore).
    """
    encoder_pp = 0 if encoder_pp is None else encoder_pp
    if encoder_tp == 0 and encoder_pp > 0:
        encoder_tp = tensor_model_parallel_size
    if encoder_tp > 0 and encoder_tp > tensor_model_parallel_size:
        raise AssertionError(
            f"encoder_tensor_model_parallel_size ({encoder_tp}) must not exceed tensor_model_parallel_size "
            f"({tensor_model_parallel_size}): encoders with more tensor parallelism than the decoder are not supported"
        )
    return encoder_tp, encoder_pp


def encoder_data_parallel_size(
    world: int, what: str, encoder_tp: int, encoder_pp: int, tp: int, pp: int, cp: int
) -> int:
    """The data-parallel size of a world split into an encoder and a decoder block.

    Every data-parallel replica holds one encoder and one decoder model:
    ``(encoder_tp x encoder_pp + tp x pp) x cp`` ranks. ``RuntimeError`` (as MCore) when
    ``world`` is not a multiple of that; ``what`` names the world in the message.
    """
    total = (encoder_tp * encoder_pp + tp * pp) * cp
    if world % total != 0:
        raise RuntimeError(
            f"{what} ({world}) is not divisible by the encoder plus decoder model size (encoder_tensor_model_"
            f"parallel_size ({encoder_tp}) x encoder_pipeline_model_parallel_size ({encoder_pp}) + tensor_model_"
            f"parallel_size ({tp}) x pipeline_model_parallel_size ({pp})) x context_parallel_size ({cp}) = {total}"
        )
    return world // total
