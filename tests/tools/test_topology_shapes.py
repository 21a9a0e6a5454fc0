"""Topologies of many modules of one shape: one layout per shape, shifted; the text report summarises them.

Expected groups come from :class:`MegatronLayout` objects built directly at each module's ranks
(``layout_of`` of ``test_topology_tool``), never from the shared shape.
"""

from __future__ import annotations

import json

from parallel_state_ng.layout.topology_spec import validate_topology
from parallel_state_ng.tools.topology.report import parse_spec
from tests.tools.test_topology_tool import check_json_against_layouts, layout_of, run_cli, write_spec


def two_rank_modules(n: int) -> list[dict]:
    return [
        {"name": f"m{i}", "ranks": [2 * i, 2 * i + 2], "tp": 2, **({"language": True} if i == 0 else {})}
        for i in range(n)
    ]


MIXED = [  # shapes A and B alternate; c0/c1 colocated and alike; the language module is shaped like A
    {"name": "lang", "ranks": [0, 4], "tp": 2, "language": True},
    {"name": "a1", "ranks": [4, 8], "tp": 2},
    {"name": "b1", "ranks": [8, 16], "tp": 2, "pp": 2, "options": {"distributed_timeout_minutes": 9}},
    {"name": "a2", "ranks": [16, 20], "tp": 2},
    {"name": "b2", "ranks": [20, 28], "tp": 2, "pp": 2, "options": {"distributed_timeout_minutes": 9}},
    {"name": "a3", "ranks": [28, 32], "tp": 2},
    {"name": "a4", "ranks": [32, 36], "tp": 2},
    {"name": "c0", "ranks": [36, 40], "tp": 4},
    {"name": "c1", "ranks": [36, 40], "tp": 4},
]


def test_placements_share_one_layout_per_shape_and_equal_fresh_ones():
    specs = parse_spec(json.dumps(MIXED))
    placements = validate_topology(specs, 40, "0.19")
    shapes = {p.name: p.shape for p in placements}
    assert shapes["lang"] is shapes["a1"] is shapes["a2"] is shapes["a4"]  # language: not a layout difference
    assert shapes["b1"] is shapes["b2"] and shapes["c0"] is shapes["c1"] and shapes["b1"] is not shapes["a1"]
    for p, module in zip(placements, MIXED):
        fresh = layout_of(module, 40)
        assert p.layout == fresh and p.layout.rank_offset == module["ranks"][0]
        for kind in fresh.kinds():
            assert p.layout.enumerate(kind) == fresh.enumerate(kind), (p.name, kind)
    again = validate_topology(list(reversed(specs)), 40, "0.19")  # shapes built at other modules
    assert sorted(again, key=lambda p: p.name) == sorted(placements, key=lambda p: p.name)


def test_mixed_shapes_json_is_complete_and_names_the_shape(capsys, tmp_path):
    code, out, err = run_cli(capsys, write_spec(tmp_path, MIXED), "--release", "0.19", "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    check_json_against_layouts(report, MIXED, 40)
    like = {m["name"]: m["shaped_like"] for m in report["modules"]}
    assert like == {
        "lang": None,
        "a1": None,  # not the language module's shape: no embedding groups
        "b1": None,
        "a2": "a1",
        "b2": "b1",
        "a3": "a1",
        "a4": "a1",
        "c0": None,
        "c1": "c0",
    }


def test_mixed_shapes_text_summary(capsys, tmp_path):
    spec = write_spec(tmp_path, MIXED)
    code, out, err = run_cli(capsys, spec, "--release", "0.19", "--kinds", "tp,dp")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[2:10] == [  # 8 spans: all shown
        "  ranks 0..3    lang",
        "  ranks 4..7    a1",
        "  ranks 8..15   b1",
        "  ranks 16..19  a2",
        "  ranks 20..27  b2",
        "  ranks 28..31  a3",
        "  ranks 32..35  a4",
        "  ranks 36..39  c0 + c1 (colocated)",
    ]
    listed = [line for line in lines if line.startswith("Module")]
    assert listed == [
        "Module lang: ranks 0..3 (4 ranks)",
        "Module a1: ranks 4..7 (4 ranks)",
        "Module b1: ranks 8..15 (8 ranks)",
        "Module a2: ranks 16..19 (4 ranks): shaped like a1, groups shifted by +12 (--full lists them)",
        "Module b2: ranks 20..27 (8 ranks): shaped like b1, groups shifted by +12 (--full lists them)",
        "Modules a3 to a4 (2 modules, ranks 28..35, 4 ranks each in turn): shaped like a1, groups shifted by each "
        "module's first rank (--full lists them)",
        "Module c0: ranks 36..39 (4 ranks), colocated with c1",
        "Module c1: ranks 36..39 (4 ranks), colocated with c0",  # colocated: listed in full
    ]
    c1 = lines.index("Module c1: ranks 36..39 (4 ranks), colocated with c0")
    assert "      0: [36, 37, 38, 39]" in lines[c1:]

    code, out, _ = run_cli(capsys, spec, "--release", "0.19", "--kinds", "tp,dp", "--full")
    assert code == 0
    lines = out.splitlines()
    a4 = lines.index("Module a4: ranks 32..35 (4 ranks)")
    assert lines[a4 + 4 : a4 + 7] == [
        "    tp - tensor model parallel [TENSOR_MODEL_PARALLEL_GROUP]: 2 groups of 2 ranks",
        "      0: [32, 33]",
        "      1: [34, 35]",
    ]


def test_many_equal_modules(capsys, tmp_path):
    modules = two_rank_modules(300)
    spec = write_spec(tmp_path, modules)
    code, out, err = run_cli(capsys, spec, "--release", "0.19")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-1] == (
        "Modules m2 to m299 (298 modules, ranks 4..599, 2 ranks each in turn): shaped like m1, groups shifted by "
        "each module's first rank (--full lists them)"
    )
    assert lines[2:8] == [
        "  ranks 0..1      m0",
        "  ranks 2..3      m1",
        "  ranks 4..5      m2",
        "  ... 295 more spans (each module's ranks: below, --full or --format json) ...",
        "  ranks 596..597  m298",
        "  ranks 598..599  m299",
    ]
    assert len(lines) < 120
    code, out, _ = run_cli(capsys, spec, "--release", "0.19", "--full")
    assert code == 0
    assert sum(line.startswith("Module m") for line in out.splitlines()) == 300
    code, out, _ = run_cli(capsys, spec, "--release", "0.19", "--format", "json", "--rank", "599")
    assert code == 0
    report = json.loads(out)
    check_json_against_layouts(report, modules, 600)
    assert [m["shaped_like"] for m in report["modules"]] == [None, None] + ["m1"] * 298
    assert report["rank"]["modules"] == ["m299"]
    assert report["rank"]["views"]["m299"]["groups"]["tp"] == {"position": 1, "ranks": [598, 599]}


def test_text_summary_answers_past_the_enumeration_limit(capsys, tmp_path, monkeypatch):
    """A world over the limit: the summary lists only the first module of each shape, so it answers;
    ``--full`` and JSON would list every group and are refused (the limit lowered to 500 ranks).
    """
    from parallel_state_ng.tools.layout import big_world

    monkeypatch.setattr(big_world, "MAX_ENUMERATED_RANKS", 500)
    spec = write_spec(tmp_path, two_rank_modules(300))  # 600 ranks; the summary enumerates m0 and m1: 4
    code, out, err = run_cli(capsys, spec, "--release", "0.19")
    assert code == 0, err
    assert out.startswith("Topology of 600 ranks, 300 modules")
    assert out.splitlines()[-1].startswith("Modules m2 to m299 (298 modules, ranks 4..599")
    for extra in (["--full"], ["--format", "json"]):
        code, out, err = run_cli(capsys, spec, "--release", "0.19", *extra)
        assert code == 2 and "600 ranks is over the limit of" in err, (extra, err)
    code, out, _ = run_cli(capsys, spec, "--release", "0.19", "--rank", "599")  # one rank's view, closed form
    assert code == 0 and "m299" in out
    monkeypatch.setattr(big_world, "MAX_ENUMERATED_RANKS", 3)  # the summary's 4 ranks are over it too
    code, _, err = run_cli(capsys, spec, "--release", "0.19")
    assert code == 2 and "600 ranks is over the limit of 3" in err
