"""Layout equivalence with the installed megatron-core.

For a deterministic (seeded) set of configurations — world sizes from 1 to 4096, every
permutation of the five MCore tokens, orders that omit size-1 tokens, rank offsets — every
group enumeration of :class:`parallel_state_ng.Layout` and :class:`parallel_state_ng.HyperCommGrid`
must equal megatron's ``RankGenerator.get_ranks`` and ``HyperCommGrid.get_rank_enum``, and the
per-rank closed forms (``group_ranks``, ``rank_in_group``, ``group_index``, ``coord``/``rank``)
must agree with the enumeration.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest

from parallel_state_ng import HyperCommGrid, Layout, UnknownDimError
from tests.support.releases.grid_checks import rank_enum

megatron_ps = pytest.importorskip("megatron.core.parallel_state")
megatron_hcg = pytest.importorskip("megatron.core.hyper_comm_grid")

TOKENS = ("tp", "cp", "ep", "dp", "pp")
MAX_WORLD = 4096
# Above this many ranks RankGenerator (pure Python) is slow: check fewer token combinations.
ALL_COMBOS_UP_TO = 512
COMBOS_FOR_LARGE = 6
RANKS_CHECKED_PER_CONFIG = 3
SIZE_CHOICES = (2, 2, 2, 3, 4, 4, 5, 6, 8, 8, 16, 32, 64)


@dataclass(frozen=True)
class Config:
    """One RankGenerator configuration: sizes of the five tokens, the order string, offset."""

    sizes: tuple[tuple[str, int], ...]  # (token, size) for all five tokens
    order: tuple[str, ...]  # tokens as given in MCore's order (size-1 tokens may be missing)
    rank_offset: int

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def world(self) -> int:
        return math.prod(s for _, s in self.sizes)

    @property
    def id(self) -> str:
        dims = ".".join(f"{t}{self.size_of[t]}" for t in self.order)
        off = f"-off{self.rank_offset}" if self.rank_offset else ""
        return f"w{self.world}-{dims}{off}"

    def layout(self) -> Layout:
        return Layout([self.size_of[t] for t in self.order], list(self.order), self.rank_offset)

    def rank_generator(self):
        s = self.size_of
        return megatron_ps.RankGenerator(
            tp=s["tp"],
            ep=s["ep"],
            dp=s["dp"],
            pp=s["pp"],
            cp=s["cp"],
            order="-".join(self.order),
            rank_offset=self.rank_offset,
        )


def _draw_sizes(rng: random.Random, big: set[str]) -> dict[str, int] | None:
    sizes = {t: (rng.choice(SIZE_CHOICES) if t in big else 1) for t in TOKENS}
    return sizes if math.prod(sizes.values()) <= MAX_WORLD else None


def _pick_big(rng: random.Random, candidates: list[str]) -> set[str]:
    """Tokens of size > 1 among ``candidates``, never ep and cp together (MCore's rule)."""
    big = {t for t in candidates if rng.random() < 0.6}
    if "ep" in big and "cp" in big:
        big.discard(rng.choice(["ep", "cp"]))
    return big


def _offset(rng: random.Random) -> int:
    return rng.choice([0, 0, rng.randint(1, 7), rng.randint(8, 5000)])


def _generate_configs(seed: int = 20250711) -> list[Config]:
    rng = random.Random(seed)
    configs: list[Config] = []

    def add(sizes: dict[str, int], order: tuple[str, ...], offset: int) -> None:
        configs.append(Config(tuple((t, sizes[t]) for t in TOKENS), order, offset))

    # 1. every permutation of all five tokens (size-1 tokens written out in the order).
    for perm in itertools.permutations(TOKENS):
        while True:
            sizes = _draw_sizes(rng, _pick_big(rng, list(TOKENS)))
            if sizes is not None:
                break
        add(sizes, perm, _offset(rng))
    # 2. orders that omit some (or all) size-1 tokens.
    while len(configs) < 300:
        big = _pick_big(rng, list(TOKENS))
        sizes = _draw_sizes(rng, big)
        if sizes is None:
            continue
        listed = [t for t in TOKENS if t in big or rng.random() < 0.3]
        if not listed:
            listed = [rng.choice(TOKENS)]  # MCore needs a non-empty order string
        rng.shuffle(listed)
        add(sizes, tuple(listed), _offset(rng))
    # 3. the edges: a world of one rank, and full 4096-rank worlds.
    add(dict.fromkeys(TOKENS, 1), ("tp",), 0)
    add(dict.fromkeys(TOKENS, 1), ("pp", "dp", "tp"), 3)
    add({"tp": 8, "cp": 2, "ep": 1, "dp": 64, "pp": 4}, ("tp", "cp", "ep", "dp", "pp"), 0)
    add({"tp": 8, "cp": 1, "ep": 8, "dp": 16, "pp": 4}, ("tp", "ep", "dp", "pp"), 4096)
    add({"tp": 4, "cp": 4, "ep": 1, "dp": 16, "pp": 16}, ("pp", "dp", "cp", "tp"), 0)
    add({"tp": 3, "cp": 1, "ep": 5, "dp": 7, "pp": 2}, ("ep", "pp", "tp", "dp"), 11)
    return configs


CONFIGS = _generate_configs()


def _shuffled(rng: random.Random, tokens: tuple[str, ...]) -> tuple[str, ...]:
    """``tokens`` in a different order than given, when there is more than one."""
    if len(tokens) < 2:
        return tokens
    while True:
        out = tuple(rng.sample(tokens, len(tokens)))
        if out != tokens:
            return out


def _combos(config: Config, rng: random.Random) -> list[tuple[str, ...]]:
    """Token combinations to check, each in a non-canonical order."""
    canonical_order = list(config.order) + [t for t in TOKENS if t not in config.order]
    subsets = [
        tuple(t for t in canonical_order if t in chosen)
        for k in range(1, len(TOKENS) + 1)
        for chosen in itertools.combinations(TOKENS, k)
    ]
    if config.world > ALL_COMBOS_UP_TO:
        subsets = [subsets[-1]] + rng.sample(subsets[:-1], COMBOS_FOR_LARGE - 1)
    return [_shuffled(rng, s) for s in subsets]


def test_configuration_set_covers_the_brief():
    assert len(CONFIGS) >= 300
    assert len({c.id for c in CONFIGS}) == len(CONFIGS), "test ids must be unique"
    worlds = {c.world for c in CONFIGS}
    assert min(worlds) == 1 and max(worlds) == MAX_WORLD
    assert len(worlds) > 40
    full_orders = {c.order for c in CONFIGS if len(c.order) == len(TOKENS)}
    assert full_orders == set(itertools.permutations(TOKENS))
    assert any(len(c.order) < len(TOKENS) for c in CONFIGS)
    assert any(c.rank_offset > 0 for c in CONFIGS) and any(c.rank_offset == 0 for c in CONFIGS)
    assert all(c.size_of["ep"] == 1 or c.size_of["cp"] == 1 for c in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.id for c in CONFIGS])
def test_layout_matches_megatron(config: Config, monkeypatch):
    rng = random.Random(config.id)
    layout = config.layout()
    generator = config.rank_generator()
    monkeypatch.setenv("WORLD_SIZE", str(config.rank_offset + config.world))
    mcore_grid = megatron_hcg.HyperCommGrid(
        [config.size_of[t] for t in config.order], list(config.order), rank_offset=config.rank_offset
    )
    our_grid = HyperCommGrid(
        [config.size_of[t] for t in config.order], list(config.order), rank_offset=config.rank_offset
    )
    ranks_to_check = rng.sample(
        range(config.rank_offset, config.rank_offset + config.world), min(RANKS_CHECKED_PER_CONFIG, config.world)
    )

    for combo in _combos(config, rng):
        expected = generator.get_ranks("-".join(combo))
        # Tokens of size 1 left out of the order are not dims of our layout; they do not
        # change any group.
        dims = [t for t in combo if t in config.order]
        ours = layout.rank_enum(dims)
        assert ours == expected, f"Layout.rank_enum({dims}) differs from RankGenerator.get_ranks({'-'.join(combo)!r})"
        assert layout.enumerate_groups(dims).tolist() == expected
        if dims:
            # megatron's HyperCommGrid takes a bare name for one dim and a list otherwise.
            arg = dims[0] if len(dims) == 1 else dims
            assert rank_enum(mcore_grid, arg) == expected  # get_rank_enum from 0.16 on
            assert rank_enum(our_grid, arg) == expected

        group_of = {r: (g, row) for g, row in enumerate(expected) for r in row}
        for rank in ranks_to_check:
            g, row = group_of[rank]
            assert layout.group_ranks(rank, dims) == row
            assert layout.rank_in_group(rank, dims) == row.index(rank)
            assert layout.group_index(rank, dims) == g
            assert layout.group_size(dims) == len(row)
            assert layout.num_groups(dims) == len(expected)

    for rank in ranks_to_check:
        coord = layout.coord(rank)
        assert layout.rank(coord) == rank
        for t in config.order:  # a coordinate is the position in the single-token group
            assert coord[t] == layout.rank_in_group(rank, t)


def test_megatron_rejects_a_sized_token_missing_from_order():
    with pytest.raises(RuntimeError, match=r"\(tp\)"):
        megatron_ps.RankGenerator(tp=2, ep=1, dp=4, pp=2, cp=1, order="dp-pp")
    # a size-1 token may be left out: megatron appends it at the end.
    generator = megatron_ps.RankGenerator(tp=1, ep=1, dp=4, pp=2, cp=1, order="dp-pp")
    assert generator.get_ranks("tp") == [[r] for r in range(8)]


def test_our_layout_has_exactly_the_dims_it_is_given():
    """Our counterpart of MCore's missing-token error.

    A Layout has no implicit tokens: its dims are the names given, in that order, and its
    size is their product. A dim with more than one rank must therefore be in the list — a
    layout built without ``tp`` simply is a smaller layout with no ``tp`` dim, and asking it
    for ``tp`` groups raises :class:`UnknownDimError` naming the dim. Size-1 dims may be
    left out, since they change no group.
    """
    without_tp = Layout([4, 2], ["dp", "pp"])
    assert without_tp.size == 8
    with pytest.raises(UnknownDimError, match="'tp'"):
        without_tp.rank_enum("tp")
    with pytest.raises(UnknownDimError, match="'tp'"):
        without_tp.rank_enum(["tp", "dp"])
    with pytest.raises(UnknownDimError, match="'tp'"):
        without_tp.group_ranks(0, ["tp"])

    with_tp = Layout([2, 4, 2], ["tp", "dp", "pp"])
    mcore = megatron_ps.RankGenerator(tp=2, ep=1, dp=4, pp=2, cp=1, order="tp-dp-pp")
    for token in ("tp", "dp", "pp", "tp-dp", "dp-pp"):
        assert with_tp.rank_enum(token.split("-")) == mcore.get_ranks(token)

    size_one_written_out = Layout([1, 4, 1, 2], ["tp", "dp", "cp", "pp"])
    for dims in (["dp"], ["pp"], ["dp", "pp"], []):
        assert size_one_written_out.rank_enum(dims) == without_tp.rank_enum(dims)
