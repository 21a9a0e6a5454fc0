"""Properties of :class:`parallel_state_ng.Layout` checked against brute force.

The expected groups here are computed by walking every rank and its coordinates (see
:func:`brute_enum`), independently of the vectorized engine: partitions, ``split`` into
hierarchical levels and into chunks/slices of combined dims, ``same_groups``, and views that
share dims.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

import pytest

from parallel_state_ng import HyperCommGrid, Layout

# ----------------------------------------------------------------- brute force


def mixed_index(digits: Sequence[int], sizes: Sequence[int]) -> int:
    """Mixed-radix number of ``digits`` (first digit fastest)."""
    value, mult = 0, 1
    for d, s in zip(digits, sizes):
        value += d * mult
        mult *= s
    return value


def mixed_digits(value: int, sizes: Sequence[int]) -> list[int]:
    """Inverse of :func:`mixed_index`."""
    out = []
    for s in sizes:
        out.append(value % s)
        value //= s
    return out


def plain_coord_fn(sizes: Sequence[int], names: Sequence[str], offset: int) -> Callable[[int], dict[str, int]]:
    """Rank -> coordinates of a plain layout (first name fastest)."""
    return lambda rank: dict(zip(names, mixed_digits(rank - offset, sizes)))


def split_coord_fn(
    sizes: Sequence[int],
    names: Sequence[str],
    offset: int,
    merged: Sequence[str],
    sub_sizes: Sequence[int],
    sub_names: Sequence[str],
) -> Callable[[int], dict[str, int]]:
    """Rank -> coordinates after re-expressing ``merged`` dims (layout order) as sub-dims."""
    parent = plain_coord_fn(sizes, names, offset)
    size_of = dict(zip(names, sizes))

    def coord(rank: int) -> dict[str, int]:
        pc = parent(rank)
        m = mixed_index([pc[d] for d in merged], [size_of[d] for d in merged])
        out = {n: c for n, c in pc.items() if n not in merged}
        out.update(zip(sub_names, mixed_digits(m, sub_sizes)))
        return out

    return coord


def brute_enum(
    ranks: Sequence[int],
    coord_of: Callable[[int], dict[str, int]],
    names: Sequence[str],
    sizes: Sequence[int],
    dims: Sequence[str],
) -> list[list[int]]:
    """Groups over ``dims``: ranks agreeing outside ``dims``; numbered by the outside
    coordinates and ordered inside by the ``dims`` coordinates (both first-fastest, in
    ``names`` order).
    """
    inside = [n for n in names if n in set(dims)]
    outside = [n for n in names if n not in set(dims)]
    size_of = dict(zip(names, sizes))
    group_size = math.prod(size_of[n] for n in inside)
    rows: dict[int, list] = {}
    for r in ranks:
        c = coord_of(r)
        g = mixed_index([c[n] for n in outside], [size_of[n] for n in outside])
        p = mixed_index([c[n] for n in inside], [size_of[n] for n in inside])
        rows.setdefault(g, [None] * group_size)[p] = r
    return [rows[g] for g in sorted(rows)]


def brute_plain(layout_args: tuple, dims: Sequence[str]) -> list[list[int]]:
    sizes, names, offset = layout_args
    ranks = range(offset, offset + math.prod(sizes))
    return brute_enum(ranks, plain_coord_fn(sizes, names, offset), names, sizes, dims)


def subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    return [c for k in range(len(names) + 1) for c in itertools.combinations(names, k)]


def random_plain_args(rng: random.Random, max_dims: int = 5, max_size: int = 720) -> tuple:
    while True:
        n = rng.randint(1, max_dims)
        sizes = [rng.choice([1, 2, 2, 3, 4, 5, 6]) for _ in range(n)]
        if math.prod(sizes) <= max_size:
            break
    names = [f"d{i}" for i in range(n)]
    rng.shuffle(names)
    return sizes, names, rng.choice([0, 0, rng.randint(1, 100)])


def assert_partition(layout: Layout, dims: Sequence[str]) -> list[list[int]]:
    """Groups over ``dims`` are disjoint, cover the layout's block, and have the announced shape."""
    groups = layout.enumerate_groups(dims)
    assert tuple(groups.shape) == (layout.num_groups(dims), layout.group_size(dims))
    assert layout.num_groups(dims) * layout.group_size(dims) == layout.size
    flat = groups.reshape(-1).tolist()
    assert sorted(flat) == list(range(layout.rank_offset, layout.rank_offset + layout.size))
    return groups.tolist()


# ----------------------------------------------------------------- partitions

PLAIN_CASES = [random_plain_args(random.Random(seed)) for seed in range(40)]


@pytest.mark.parametrize(
    "args", PLAIN_CASES, ids=lambda a: "-".join(f"{n}{s}" for n, s in zip(a[1], a[0])) + f"-off{a[2]}"
)
def test_every_dim_subset_partitions_the_block(args):
    sizes, names, offset = args
    layout = Layout(sizes, names, offset)
    for dims in subsets(names):
        groups = assert_partition(layout, dims)
        assert groups == brute_plain(args, dims)
        assert layout.group_size(dims) == math.prod(layout.size_of(d) for d in dims)


def test_zero_dims_and_all_dims():
    layout = Layout([2, 3], ["a", "b"], rank_offset=10)
    assert layout.rank_enum([]) == [[r] for r in range(10, 16)]
    assert layout.rank_enum(["b", "a"]) == [list(range(10, 16))]
    assert layout.num_groups([]) == 6 and layout.group_size([]) == 1


# ----------------------------------------------------------------- split: one dim


def hierarchical_subgroups(ranks: list[int], level_sizes: list[int], level: int) -> list[list[int]]:
    """Level-``level`` sub-groups of ``ranks`` by brute force over indices.

    Index ``i`` of ``ranks`` has digits over ``level_sizes`` (first fastest); a level-k
    sub-group holds the indices that agree on every digit but digit k, ordered by digit k.
    """
    by_key: dict[tuple, list] = {}
    for i, r in enumerate(ranks):
        digits = mixed_digits(i, level_sizes)
        key = tuple(d for j, d in enumerate(digits) if j != level)
        by_key.setdefault(key, [None] * level_sizes[level])[digits[level]] = r
    others = [s for j, s in enumerate(level_sizes) if j != level]
    return [by_key[k] for k in sorted(by_key, key=lambda k: mixed_index(k, others))]


HIERARCHICAL_CASES = [
    ([2, 8, 2, 2], ["tp", "cp", "dp", "pp"], 0, [2, 4]),
    ([2, 8, 2, 2], ["tp", "cp", "dp", "pp"], 5, [2, 2, 2]),
    ([2, 12, 3], ["tp", "cp", "pp"], 0, [3, 4]),
    ([3, 2, 12], ["dp", "tp", "cp"], 7, [2, 3, 2]),
    ([16, 2], ["cp", "pp"], 0, [4, 2, 2]),
    ([2, 6, 2], ["pp", "cp", "tp"], 0, [6]),
]


@pytest.mark.parametrize("sizes,names,offset,levels", HIERARCHICAL_CASES)
def test_split_one_dim_gives_hierarchical_levels(sizes, names, offset, levels):
    layout = Layout(sizes, names, offset)
    level_names = [f"cp{k}" for k in range(len(levels))]
    split = layout.split("cp", levels, level_names)
    assert split.is_plain
    assert split.dim_names == [n for name in names for n in (level_names if name == "cp" else [name])]

    expected_by_level: list[set] = [set() for _ in levels]
    for cp_group in layout.rank_enum("cp"):
        for k in range(len(levels)):
            subs = hierarchical_subgroups(cp_group, levels, k)
            expected_by_level[k].update(map(tuple, subs))
            for sub in subs:
                for r in sub:
                    assert split.group_ranks(r, level_names[k]) == sub
    for k, name in enumerate(level_names):
        groups = assert_partition(split, [name])
        assert set(map(tuple, groups)) == expected_by_level[k]
    # the levels together are the cp groups again, in the same order
    assert split.rank_enum(level_names) == layout.rank_enum("cp")
    for dims in subsets(split.dim_names):
        assert_partition(split, dims)


def test_hierarchical_levels_match_megatrons_create_hierarchical_groups(monkeypatch):
    megatron_ps = pytest.importorskip("megatron.core.parallel_state")
    # Record the sub-groups megatron would create instead of creating process groups.
    monkeypatch.setattr(megatron_ps, "create_group", lambda ranks, **kwargs: list(ranks))
    layout = Layout([2, 8, 2], ["tp", "cp", "dp"], rank_offset=3)
    levels = [2, 2, 2]
    split = layout.split("cp", levels, ["h0", "h1", "h2"])
    for cp_group in layout.rank_enum("cp"):
        for rank in cp_group:
            if hasattr(megatron_ps, "create_hierarchical_groups"):  # 0.13 on
                theirs, _ = megatron_ps.create_hierarchical_groups(rank, cp_group, levels)
            else:  # 0.12: the same levels from its hierarchical_parallel variant
                theirs = megatron_ps.create_hierarchical_parallel_groups(rank, cp_group, len(cp_group), levels, None)
            assert theirs == [split.group_ranks(rank, f"h{k}") for k in range(len(levels))]


# ----------------------------------------------------------------- split: dims together


MULTI_SPLIT_CASES = [
    # (sizes, names, offset, dims to split, split shape) — adjacent dims
    ([2, 3, 4, 2], ["tp", "cp", "dp", "pp"], 0, ["cp", "dp"], [6, 2]),
    ([2, 3, 4, 2], ["tp", "cp", "dp", "pp"], 9, ["dp", "cp"], [3, 4]),
    ([2, 6, 2, 2], ["tp", "cp", "dp", "pp"], 0, ["cp", "dp"], [4, 3]),  # non-product split
    ([2, 2, 1, 4, 2], ["tp", "cp", "ep", "dp", "pp"], 0, ["cp", "dp"], [2, 4]),  # size-1 dim between
    # non-adjacent dims
    ([6, 2, 2, 2], ["cp", "tp", "dp", "pp"], 0, ["cp", "dp"], [4, 3]),
    ([2, 2, 3, 4], ["tp", "cp", "pp", "dp"], 4, ["cp", "dp"], [2, 4]),
    ([3, 2, 5], ["tp", "pp", "dp"], 0, ["tp", "dp"], [5, 3]),
    ([2, 3, 2, 2], ["cp", "tp", "dp", "pp"], 1, ["cp", "dp", "pp"], [2, 2, 2]),
]


def _multi_split_id(case) -> str:
    sizes, names, offset, dims, shape = case
    layout = "-".join(f"{n}{s}" for n, s in zip(names, sizes))
    return f"{layout}-off{offset}-split_{'.'.join(dims)}_into_{'x'.join(map(str, shape))}"


@pytest.mark.parametrize("case", MULTI_SPLIT_CASES, ids=_multi_split_id)
def test_split_dims_together(case):
    sizes, names, offset, dims, shape = case
    layout = Layout(sizes, names, offset)
    sub_names = [f"s{k}" for k in range(len(shape))]
    split = layout.split(dims, shape, sub_names)
    merged = layout.dims(dims)  # layout order
    positions = [names.index(d) for d in merged]
    adjacent = all(sizes[i] == 1 or names[i] in merged for i in range(positions[0], positions[-1] + 1))
    assert split.is_plain == adjacent

    # every subset of the new dims matches brute force over the split coordinates
    coord_of = split_coord_fn(sizes, names, offset, merged, shape, sub_names)
    ranks = range(offset, offset + layout.size)
    for sub in subsets(split.dim_names):
        assert assert_partition(split, sub) == brute_enum(ranks, coord_of, split.dim_names, split.shape, sub)

    # with two sub-dims: contiguous chunks and strided slices of each combined group
    if len(shape) == 2:
        intra, _ = shape
        chunks, slices = set(), set()
        for combined in layout.rank_enum(merged):
            chunks.update(tuple(combined[i : i + intra]) for i in range(0, len(combined), intra))
            slices.update(tuple(combined[i::intra]) for i in range(intra))
        assert set(map(tuple, split.rank_enum("s0"))) == chunks
        assert set(map(tuple, split.rank_enum("s1"))) == slices
    assert split.rank_enum(sub_names) == layout.rank_enum(merged)


def test_megatron_style_partial_data_parallel_groups():
    """Chunks of each dp-cp group, as megatron's intra-partial data-parallel groups."""
    tp, cp, dp, pp, instances = 2, 2, 6, 2, 3
    layout = Layout([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"])
    intra = cp * dp // instances
    split = layout.split(["cp", "dp"], [intra, instances], ["intra", "inter"])
    for ranks_with_cp in layout.rank_enum(["dp", "cp"]):
        for i in range(instances):
            chunk = ranks_with_cp[i * intra : (i + 1) * intra]
            for r in chunk:
                assert split.group_ranks(r, "intra") == chunk
                assert split.group_ranks(r, "inter") == ranks_with_cp[split.rank_in_group(r, "intra") :: intra]


def test_split_rejects_bad_shapes():
    layout = Layout([2, 6, 2], ["tp", "cp", "dp"])
    with pytest.raises(ValueError, match="product 8"):
        layout.split("cp", [2, 4], ["a", "b"])
    with pytest.raises(ValueError, match="tp"):
        layout.split("cp", [2, 3], ["tp", "b"])
    with pytest.raises(ValueError, match="at least one dim"):
        layout.split([], [1], ["a"])


# ----------------------------------------------------------------- same_groups


def _variant(rng: random.Random, sizes: list[int], names: list[str], inside: set[str]):
    """A layout derived from (sizes, names) that often has the same groups over ``inside``.

    Returns (sizes, names, inside) of the variant.
    """
    sizes, names, inside = list(sizes), list(names), set(inside)
    fresh = iter(f"v{i}" for i in itertools.count())
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["insert1", "factor", "merge", "swap", "flip", "resize"])
        i = rng.randrange(len(names))
        if kind == "insert1":  # a size-1 dim, inside or not: changes nothing
            n = next(fresh)
            sizes.insert(i, 1)
            names.insert(i, n)
            if rng.random() < 0.5:
                inside.add(n)
        elif kind == "factor" and sizes[i] in (4, 6):  # a dim re-expressed as two: same groups
            a = 2
            n1, n2 = next(fresh), next(fresh)
            was_inside = names[i] in inside
            inside.discard(names[i])
            sizes[i : i + 1] = [a, sizes[i] // a]
            names[i : i + 1] = [n1, n2]
            if was_inside:
                inside |= {n1, n2}
        elif kind == "merge" and i + 1 < len(names) and (names[i] in inside) == (names[i + 1] in inside):
            n = next(fresh)
            was_inside = names[i] in inside
            inside -= {names[i], names[i + 1]}
            sizes[i : i + 2] = [sizes[i] * sizes[i + 1]]
            names[i : i + 2] = [n]
            if was_inside:
                inside.add(n)
        elif kind == "swap" and i + 1 < len(names):  # usually changes the groups
            sizes[i], sizes[i + 1] = sizes[i + 1], sizes[i]
            names[i], names[i + 1] = names[i + 1], names[i]
        elif kind == "flip":  # a dim moves in or out of the group
            inside ^= {names[i]}
        elif kind == "resize" and len(names) > 1 and sizes[i] % 2 == 0:  # same total size
            j = (i + 1) % len(names)
            sizes[i] //= 2
            sizes[j] *= 2
    return sizes, names, inside


def test_same_groups_fast_path_agrees_with_brute_force():
    rng = random.Random(7)
    verdicts = []
    for _ in range(400):
        sizes, names, offset = random_plain_args(rng, max_dims=4, max_size=240)
        inside = {n for n in names if rng.random() < 0.5}
        v_sizes, v_names, v_inside = _variant(rng, sizes, names, inside)
        v_offset = offset if rng.random() < 0.9 else offset + 1
        a = Layout(sizes, names, offset)
        b = Layout(v_sizes, v_names, v_offset)
        assert a.is_plain and b.is_plain
        brute = (
            a.size == b.size
            and offset == v_offset
            and brute_plain((sizes, names, offset), inside) == brute_plain((v_sizes, v_names, v_offset), v_inside)
        )
        assert a.same_groups(sorted(inside), b, sorted(v_inside)) == brute, (a, inside, b, v_inside)
        assert b.same_groups(sorted(v_inside), a, sorted(inside)) == brute
        verdicts.append(brute)
    # the generator must exercise both answers
    assert 100 < sum(verdicts) < 350


def test_same_groups_with_a_composed_layout():
    base = Layout([2, 3, 2, 2], ["cp", "tp", "dp", "pp"])
    composed = base.split(["cp", "dp"], [4, 1], ["a", "b"])  # non-adjacent: composed layout
    assert not composed.is_plain
    for dims_base, dims_comp in [(["cp", "dp"], ["a"]), (["tp"], ["tp"]), (["tp", "pp"], ["tp", "pp"])]:
        assert composed.same_groups(dims_comp, base, dims_base)
        assert base.same_groups(dims_base, composed, dims_comp)
    assert not composed.same_groups(["a"], base, ["cp"])
    # pp: the same sets of ranks, but numbered differently (the composed layout counts its
    # groups by a = cp + 2*dp before tp, the base by cp, tp, dp), so not the same enumeration —
    # megatron's check of the expert pp groups compares the lists in order, too.
    assert sorted(composed.rank_enum("pp")) == sorted(base.rank_enum("pp"))
    assert composed.rank_enum("pp") != base.rank_enum("pp")
    assert not composed.same_groups(["pp"], base, ["pp"])
    plain = Layout([2, 3, 2, 2], ["cp", "tp", "dp", "pp"], rank_offset=1)
    assert not composed.same_groups(["tp"], plain, ["tp"])  # different offsets


# ----------------------------------------------------------------- views with shared dims

EXPERT_CASES = [
    # dense (tp, cp, dp, pp), expert (etp, ep), order — pp last in the order: pp is shared
    ((2, 1, 4, 2), (2, 2), "tp-cp-ep-dp-pp"),
    ((2, 2, 2, 2), (1, 4), "tp-cp-ep-dp-pp"),
    ((4, 1, 2, 3), (1, 8), "tp-cp-ep-dp-pp"),
    ((2, 1, 4, 2), (1, 2), "tp-ep-dp-pp"),
    ((1, 2, 3, 2), (2, 3), "tp-cp-dp-ep-pp"),
]


@pytest.mark.parametrize("dense,expert,order", EXPERT_CASES, ids=lambda x: str(x).replace(" ", ""))
def test_expert_view_shares_pp_and_matches_megatron(dense, expert, order, monkeypatch):
    megatron_ps = pytest.importorskip("megatron.core.parallel_state")
    tp, cp, dp, pp = dense
    etp, ep = expert
    world = tp * cp * dp * pp
    edp = world // (etp * ep * pp)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    tokens = order.split("-")
    size = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": 1}
    grid = HyperCommGrid([size[t] for t in tokens], tokens)
    rename = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    expert_size = {"etp": etp, "ep": ep, "edp": edp, "pp": pp}
    expert_names = [rename[t] for t in tokens if t != "cp"]
    view = grid.register_view("expert", [expert_size[n] for n in expert_names], expert_names, shared_dims=["pp"])
    assert view.same_groups("pp", grid.layout)
    assert grid.get_rank_enum("pp", view="expert") == grid.get_rank_enum("pp")

    mcore = megatron_ps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    for token in ("ep", "tp", "tp-ep", "tp-ep-pp", "dp", "pp"):
        dims = [rename[t] for t in token.split("-")]
        assert grid.get_rank_enum(dims, view="expert") == mcore.get_ranks(token)


def test_shared_dim_must_have_the_same_groups(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    grid = HyperCommGrid([2, 2, 4], ["tp", "pp", "dp"])  # pp not last: stride tp
    with pytest.raises(ValueError, match="shared dim 'pp'"):
        grid.register_view("expert", [1, 4, 2, 2], ["etp", "ep", "pp", "edp"], shared_dims=["pp"])
    # the same view with etp == tp keeps pp's stride: accepted
    grid.register_view("expert", [2, 2, 4], ["etp", "pp", "ep"], shared_dims=["pp"])


def test_split_view_on_a_grid(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "40")
    grid = HyperCommGrid([2, 8, 2], ["tp", "cp", "dp"], rank_offset=8)
    view = grid.register_split_view("hcp", "cp", [2, 4], ["cp0", "cp1"])
    assert grid.view_layout("hcp") is view
    for cp_group in grid.get_rank_enum("cp"):
        for level, name in enumerate(["cp0", "cp1"]):
            for sub in hierarchical_subgroups(cp_group, [2, 4], level):
                assert sub in grid.get_rank_enum(name, view="hcp")
    assert grid.get_rank_enum("tp", view="hcp") == grid.get_rank_enum("tp")
