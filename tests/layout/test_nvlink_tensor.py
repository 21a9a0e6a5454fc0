"""The runtime NVLink check's tensor path against the list path and brute force.

``kind_group_blocks`` must give ``MegatronLayout.enumerate``'s groups row for row,
``crossing_stats_tensor`` on them ``crossing_stats``' result on the lists, and ``check_domains``
the same findings whichever way the groups come; on a table of layouts (orders, 0.19's GTP axes,
0.17's rank range, a 0.12/0.13 encoder block, derived kinds) and domain maps (partial last
domain, domains that are not intervals, participants that are not a range). The check's Python
work does not grow with the world: its Python calls are counted at two world sizes.
"""

from __future__ import annotations

import gc
import random
import sys
import warnings
from collections.abc import Callable

import pytest
import torch

from parallel_state_ng.groups import nvlink_check
from parallel_state_ng.groups.agreement import AgreementResult
from parallel_state_ng.groups.nvlink_check import (
    NvlinkDomainError,
    check_domains,
    domain_table,
    encode_domain_id,
    summarize_domain_ids,
)
from parallel_state_ng.groups.pipeline import check_nvlink_domains
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.named_layout import Layout
from parallel_state_ng.layout.nvlink_domains import (
    LATENCY_CRITICAL_KINDS,
    GroupRows,
    crossing_stats,
    crossing_stats_tensor,
    kind_group_blocks,
)

LAYOUTS = {
    "0.19 tp2 pp2 ep4 etp1": dict(
        world_size=16,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
        release="0.19",
    ),
    "0.19 cp2 order tp-dp-cp-pp": dict(
        world_size=16, tensor_model_parallel_size=2, context_parallel_size=2, order="tp-dp-cp-pp", release="0.19"
    ),
    "0.16 order cp-ep-dp-tp-pp": dict(
        world_size=24,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        order="cp-ep-dp-tp-pp",
        release="0.16",
    ),
    "0.19 GTP 2/2": dict(
        world_size=16,
        tensor_model_parallel_size=2,
        gtp_remat_size=2,
        expert_model_parallel_size=2,
        expert_gtp_remat_size=2,
        release="0.19",
    ),
    "0.17 ranks 8-23": dict(
        world_size=32,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=4,
        rank_offset=8,
        local_world_size=16,
        release="0.17",
    ),
    "0.14 hcp, 2 optimizer instances": dict(
        world_size=16,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
        num_distributed_optimizer_instances=2,
        release="0.14",
    ),
    "0.13 encoder tp2": dict(
        world_size=24,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        encoder_tensor_model_parallel_size=2,
        encoder_pipeline_model_parallel_size=1,
        release="0.13",
    ),
}

#: Domain maps over the world: rank -> domain id (``None``: not a participant).
MAPS: dict[str, Callable[[int, int], str | None]] = {
    "5 per domain, partial last": lambda r, world: f"rack-{r // 5}",
    "8 per domain": lambda r, world: f"rack-{r // 8}",
    "interleaved (not intervals)": lambda r, world: f"rack-{(r // 3) % 2}",
    "shuffled": lambda r, world: f"rack-{random.Random(r * 7919 + world).randrange(3)}",
    "odd ranks only, 6 per domain": lambda r, world: f"rack-{r // 6}" if r % 2 else None,
}


def _rows(block: GroupRows | torch.Tensor) -> torch.Tensor:
    return block.rows() if isinstance(block, GroupRows) else block


def _brute_lookup(world: int, domain_id: Callable[[int, int], str | None]) -> dict[int, int]:
    """Rank -> domain number (numbered by first appearance over the participants)."""
    numbers: dict[str, int] = {}
    out = {}
    for r in range(world):
        found = domain_id(r, world)
        if found is not None:
            out[r] = numbers.setdefault(found, len(numbers))
    return out


def _summary(world: int, domain_id: Callable[[int, int], str | None]) -> dict:
    ranks = [r for r in range(world) if domain_id(r, world) is not None]
    values = [encode_domain_id(("env", domain_id(r, world))) for r in ranks]  # type: ignore[arg-type]
    return summarize_domain_ids(range(world) if len(ranks) == world else ranks, values)  # type: ignore[return-value]


def _contiguous(summary: dict) -> bool:
    """What check_domains takes for contiguous: one run per domain over a range of participants."""
    return len(summary["runs"]) == len({d for d, _ in summary["runs"]}) and "range" in summary["ranks"]


@pytest.mark.parametrize("config", list(LAYOUTS))
def test_tensor_groups_and_stats_equal_the_list_path(config):
    layout = MegatronLayout(**LAYOUTS[config])
    world = layout.world_size
    derived = []
    for kind in layout.kinds():
        blocks = kind_group_blocks(layout, kind)
        groups = layout.enumerate(kind)
        if blocks is None:
            derived.append(kind)
            continue
        assert [row for block in blocks for row in _rows(block).tolist()] == groups, kind
    assert not set(derived) & set(LATENCY_CRITICAL_KINDS)  # the kept kinds always go as tensors
    if layout.encoder_block is None:
        assert "pp" not in derived and "mp" not in derived
    for map_name, domain_id in MAPS.items():
        lookup = _brute_lookup(world, domain_id)
        summary = _summary(world, domain_id)
        first, table = domain_table(summary)
        assert {r: int(table[r - first]) for r in lookup} == lookup, map_name
        outside = [r for r in range(world) if r not in lookup and 0 <= r - first < len(table)]
        assert all(int(table[r - first]) == -1 for r in outside)
        for kind in layout.kinds():
            blocks = kind_group_blocks(layout, kind)
            if blocks is None:
                continue
            groups = layout.enumerate(kind)
            rows = tuple(_rows(block) for block in blocks)
            for contiguous in (True, False):
                expected = crossing_stats(groups, lambda r: lookup.get(r, -1), examples=5, contiguous=contiguous)
                for given in (blocks, rows):
                    got = crossing_stats_tensor(given, table, first_rank=first, examples=5, contiguous=contiguous)
                    assert got == expected, (config, map_name, kind, contiguous)


@pytest.mark.parametrize("map_name", list(MAPS))
def test_check_domains_findings_equal_for_tensors_and_lists(monkeypatch, map_name):
    monkeypatch.setenv(nvlink_check.ENV_KEEP_INSIDE, "tp,cp,ep,ep_tp,tp_ep_mp,dp,pp,tp_dp,intra_dist_opt_instance")
    monkeypatch.delenv(nvlink_check.ENV_CHECK, raising=False)
    layouts = {name: MegatronLayout(**LAYOUTS[name]) for name in ("0.19 tp2 pp2 ep4 etp1", "0.19 GTP 2/2")}
    summary = _summary(16, MAPS[map_name])

    def as_lists(kinds):
        return {label: {k: lay.enumerate(k) for k in kinds if k in lay.kinds()} for label, lay in layouts.items()}

    def as_tensors(kinds):
        return {
            label: {k: kind_group_blocks(lay, k) or lay.enumerate(k) for k in kinds if k in lay.kinds()}
            for label, lay in layouts.items()
        }

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_lists = check_domains(summary, as_lists, name="init", rank=-1)
        from_tensors = check_domains(summary, as_tensors, name="init", rank=-1)
    assert from_tensors == from_lists
    assert from_lists  # every map has crossing kinds here (dp crosses 5-, 6- and 8-rank domains)
    assert not caught  # rank -1 is no participant: no warning
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "error")
    errors = []
    for groups_of in (as_lists, as_tensors):
        with pytest.raises(NvlinkDomainError) as err:
            check_domains(summary, groups_of, name="init", rank=0)
        errors.append(str(err.value))
    assert errors[0] == errors[1]


def test_topology_with_rank_offsets_and_a_grid(monkeypatch):
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "warn")
    monkeypatch.setenv(nvlink_check.ENV_KEEP_INSIDE, "tp,ep,tp_ep_mp,dp")
    vision = MegatronLayout(world_size=40, tensor_model_parallel_size=2, local_world_size=10, release="0.19")
    language = MegatronLayout(  # ranks 10-33: tp group 14-17 crosses the 8-rank domains at 16
        world_size=40,
        tensor_model_parallel_size=4,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
        rank_offset=10,
        local_world_size=24,
        release="0.19",
    )
    grid = Layout([4, 10], ["tp", "dp"])
    layouts = {"vision": vision, "language": language, "grid": grid}
    summary = _summary(40, MAPS["8 per domain"])
    result = AgreementResult("build_topology", False, "agreed", 40, summary=summary)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        findings = check_nvlink_domains(result, layouts, name="build_topology", rank=5)

    def as_lists(kinds):
        out = {}
        for label, lay in layouts.items():
            if isinstance(lay, Layout):
                out[label] = {k: lay.rank_enum([k]) for k in kinds if k in lay.dim_names}
            else:
                out[label] = {k: lay.enumerate(k) for k in kinds if k in lay.kinds()}
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = check_domains(summary, as_lists, name="build_topology", rank=5)
    assert findings == expected
    assert [f.split(" of ")[0] for f in findings if f.startswith("language: tp:")] == ["language: tp: 3"]
    assert any(f.startswith("grid: dp:") for f in findings)


def test_group_rows_of_plain_and_split_layouts():
    plain = Layout([2, 3, 2], ["tp", "dp", "pp"], rank_offset=4)
    split = Layout([2, 2, 2], ["a", "b", "c"]).split(["a", "c"], [2, 2], ["x", "y"])  # not a sum of strides
    assert not split.is_plain
    table = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5])  # 3 ranks per domain
    for layout in (plain, split):
        for dims in (["b"], ["x"], ["y"], ["x", "b"]) if layout is split else (["tp"], ["dp"], ["tp", "pp"], []):
            block = GroupRows.of(layout, dims)
            assert isinstance(block, GroupRows) == layout.is_plain
            assert torch.equal(_rows(block), layout.enumerate_groups(dims)), (layout, dims)
            for contiguous in (True, False):
                expected = crossing_stats(layout.rank_enum(dims), lambda r: int(table[r]), contiguous=contiguous)
                assert crossing_stats_tensor(block, table, contiguous=contiguous) == expected, (layout, dims)


def test_bad_blocks_name_the_block():
    with pytest.raises(ValueError, match=r"groups\[1\] must be a 2-D integer tensor .* got \(4,\)"):
        crossing_stats_tensor((torch.zeros(2, 2, dtype=torch.int64), torch.arange(4)), torch.zeros(4))
    with pytest.raises(ValueError, match=r"groups\[0\] must be a 2-D integer tensor .* got list"):
        crossing_stats_tensor([[0, 1]], torch.zeros(4))  # type: ignore[list-item]


def _python_calls(world: int) -> int:
    """Python function calls of one rank's check of a ``world``-rank layout (tensors only)."""
    layout = MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=4,
        expert_model_parallel_size=16,
        expert_tensor_parallel_size=1,
        release="0.19",
    )
    per = 72  # ep 16 does not divide 72: ep and tp_ep_mp groups cross
    runs = [[d, min(per, world - d * per)] for d in range(-(-world // per))]
    summary = {"ranks": {"range": [0, world]}, "runs": runs, "ids": None}
    result = AgreementResult("init", False, "agreed", world, summary=summary)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    gc.collect()
    gc.disable()  # no finalizer of unrelated objects runs inside the counted stretch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.setprofile(count)
        try:
            findings = check_nvlink_domains(result, {"": layout}, name="init", rank=1)
        finally:
            sys.setprofile(None)
            gc.enable()
    assert [f.split(":")[0] for f in findings] == ["ep", "tp_ep_mp"]
    return calls


def test_python_work_does_not_grow_with_the_world(monkeypatch):
    monkeypatch.delenv(nvlink_check.ENV_CHECK, raising=False)
    monkeypatch.delenv(nvlink_check.ENV_KEEP_INSIDE, raising=False)

    def no_lists(self, kind):
        raise AssertionError(f"enumerated {kind} as lists")

    monkeypatch.setattr(MegatronLayout, "enumerate", no_lists)
    assert _python_calls(4608) == _python_calls(73728)  # 64 and 1024 domains of 72
