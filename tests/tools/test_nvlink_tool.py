"""NVLink domains in the layout and topology tools, checked against brute-force domain math.

Crossing counts come from ``MegatronLayout``'s groups and ``rank // ranks_per_domain`` computed
here; suggestions are checked for what they claim (accepted by the release, ranked by what
crosses); the committed picture docs/nvl72_144.svg is what the tool draws.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest

from parallel_state_ng.__main__ import main
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.nvlink_domains import LATENCY_CRITICAL_KINDS, NvlinkDomains, crossing_stats
from parallel_state_ng.layout.nvlink_suggest import suggest_fill, suggest_orders, why_crossing
from tests.support.paths import ROOT

SVG = "{http://www.w3.org/2000/svg}"


def _run(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _brute_crossing(groups: list[list[int]], per: int) -> int:
    return sum(1 for g in groups if min(g) // per != max(g) // per or len({r // per for r in g}) > 1)


@pytest.mark.parametrize(
    "world,tp,pp,ep,etp,size,used",
    [
        (288, 2, 2, 16, 1, 72, None),
        (128, 2, 1, 64, 1, 72, None),
        (128, 2, 1, 64, 1, 72, 64),
        (144, 8, 2, 8, 1, 72, None),
    ],
)
def test_json_crossing_stats_match_brute_force(capsys, world, tp, pp, ep, etp, size, used):
    argv = ["layout", "--world-size", str(world), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]
    argv += ["--etp", str(etp), "--nvlink-domain-size", str(size), "--format", "json", "--release", "0.19"]
    if used is not None:
        argv += ["--gpus-used-per-domain", str(used)]
    section = json.loads(_run(capsys, *argv))["report"]["nvlink"]
    layout = MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        release="0.19",
    )
    per = used or size
    assert section["domains"]["num_domains"] == -(-world // per)
    for kind, stats in section["kinds"].items():
        groups = layout.enumerate(kind)
        assert stats["num_groups"] == len(groups)
        assert stats["crossing_groups"] == _brute_crossing(groups, per)
        assert sum(stats["histogram"].values()) == len(groups)
        assert stats["max_domains"] == max(len({r // per for r in g}) for g in groups)
    expected = [k for k in LATENCY_CRITICAL_KINDS if k in section["kinds"] and section["kinds"][k]["crossing_groups"]]
    assert section["crossing_kinds"] == expected


def test_text_report_warns_and_suggests_a_fill(capsys):
    out = _run(
        capsys,
        *("layout", "--world-size", "128", "--tp", "2", "--ep", "64", "--etp", "1", "--release", "0.19"),
        *("--nvlink-domain-size", "72", "--suggest-order", "--kinds", "tp,ep"),
    )
    assert "NVLink domains: 2 of 72 GPUs (domain = rank // 72, the last holds 56):" in out
    assert "WARNING: kinds that should stay inside a domain" in out
    assert "ep groups have 64 ranks, which does not divide the 56 ranks" in out
    assert "--gpus-used-per-domain 64 with --order tp-cp-ep-dp-pp keeps them inside (2 domains" in out
    fixed = _run(
        capsys,
        *("layout", "--world-size", "128", "--tp", "2", "--ep", "64", "--etp", "1", "--release", "0.19"),
        *("--nvlink-domain-size", "72", "--gpus-used-per-domain", "64", "--kinds", "tp,ep"),
    )
    assert "64 of 72 used" in fixed and "none crosses" in fixed


def test_suggested_orders_are_accepted_ranked_and_merged():
    arguments = dict(world_size=144, tensor_model_parallel_size=2, expert_model_parallel_size=8, release="0.19")
    domains = NvlinkDomains(72)
    candidates = suggest_orders(arguments, domains, ["tp", "ep"])
    keys = [c.rank_key for c in candidates]
    assert keys == sorted(keys)
    seen = set()
    for c in candidates:
        for order in (c.order, *c.same_as):
            assert order not in seen
            seen.add(order)
            layout = MegatronLayout(**arguments, order=order)  # accepted by the release
            for kind in ("tp", "ep"):
                assert c.crossing[kind] == _brute_crossing(layout.enumerate(kind), 72)
    assert len(seen) == 120  # pp 1: every permutation is accepted
    assert candidates[0].crossing_kinds == ()


def test_why_and_fill_for_a_group_larger_than_a_domain():
    arguments = dict(
        world_size=256,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=64,
        expert_tensor_parallel_size=2,
        release="0.19",
    )
    domains = NvlinkDomains(72, 64)
    layout = MegatronLayout(**arguments)
    assert why_crossing(layout, domains, ["tp_ep_mp"]) == [
        "tp_ep_mp groups have 128 ranks, more than the 64 ranks of a domain"
    ]
    assert suggest_fill(arguments, domains, LATENCY_CRITICAL_KINDS, 4) is None
    assert crossing_stats([[0, 1], [70, 71, 72]], NvlinkDomains(72).domain_of)["histogram"] == {"1": 1, "2": 1}


def test_svg_draws_domains_and_marks_crossing_groups(capsys, tmp_path):
    out_file = tmp_path / "nvl.svg"
    _run(
        capsys,
        *("layout", "--world-size", "144", "--tp", "2", "--pp", "3", "--ep", "16", "--etp", "1"),
        *("--nvlink-domain-size", "72", "--format", "svg", "--color-kind", "ep", "-o", str(out_file)),
    )
    root = ET.parse(out_file).getroot()
    bands = [el for el in root.iter(f"{SVG}rect") if el.get("class") == "domain"]
    assert [b.get("data-domain") for b in bands] == ["0", "1"]
    layout = MegatronLayout(
        world_size=144,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        expert_model_parallel_size=16,
        expert_tensor_parallel_size=1,
    )
    crossing = {r for g in layout.enumerate("ep") if len({x // 72 for x in g}) > 1 for r in g}
    marked = {int(el.get("data-rank")) for el in root.iter(f"{SVG}rect") if el.get("data-crossing") == "1"}
    assert marked == crossing and crossing


def test_docs_picture_is_current(capsys):
    """docs/nvl72_144.svg is what the command in docs/nvlink.md draws."""
    out = _run(
        capsys,
        *("layout", "--world-size", "144", "--tp", "2", "--pp", "3", "--ep", "16", "--etp", "1"),
        *("--nvlink-domain-size", "72", "--format", "svg", "--color-kind", "ep"),
    )
    with open(os.path.join(ROOT, "docs", "nvl72_144.svg"), encoding="utf-8") as fh:
        assert out == fh.read()


def test_topology_report_and_placements(capsys, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            [
                {"name": "vision", "ranks": [0, 36], "tp": 4},
                {"name": "language", "ranks": [36, 140], "tp": 8, "language": True},
            ]
        )
    )
    common = [str(spec), "--release", "0.19", "--nvlink-domain-size", "72"]
    report = json.loads(_run(capsys, "topology", *common, "--format", "json", "--suggest-placement"))["nvlink"]
    # language on ranks 36..139 with tp 8: the tp group 68..75 straddles rank 72
    language = MegatronLayout(
        world_size=140, tensor_model_parallel_size=8, rank_offset=36, local_world_size=104, release="0.19"
    )
    tp = report["modules"]["language"]["kinds"]["tp"]
    assert tp["crossing_groups"] == _brute_crossing(language.enumerate("tp"), 72) == 1
    assert report["crossing_kinds"] == ["language:tp", "language:ep_tp", "language:tp_ep_mp"]  # etp = tp
    best = report["suggestions"][0]  # the language model first: its tp groups start on domain boundaries
    assert best["crossing_kinds"] == [] and best["spans"] == [[36, 140], [0, 36]]
    assert best["modules"]["language"]["ranks"] == [0, 104] and best["modules"]["vision"]["ranks"] == [104, 140]
    keys = [(len(s["crossing_kinds"]), s["crossing_groups"]) for s in report["suggestions"]]
    assert keys == sorted(keys)
    svg = _run(capsys, "topology", *common, "--format", "svg")
    root = ET.fromstring(svg)
    assert [el.get("data-domain") for el in root.iter(f"{SVG}line") if el.get("class") == "domain-start"] == ["0", "1"]


@pytest.mark.parametrize("shape", [(288, 72, 72, 2, 2, 16, 1), (128, 72, 72, 2, 2, 64, 1), (256, 72, 64, 2, 2, 64, 2)])
def test_docs_crossing_table_rows_are_what_the_script_prints(shape):
    """Rows of docs/results/nvlink.md's table, recomputed by scripts/bench/nvlink_table.py (the whole
    table: ``python -m scripts.bench nvlink_table``).
    """
    from scripts.bench.nvlink_table import markdown_row, row

    computed = row(*shape)
    assert computed is not None
    with open(os.path.join(ROOT, "docs", "results", "nvlink.md"), encoding="utf-8") as fh:
        assert markdown_row(computed) + "\n" in fh.read()
