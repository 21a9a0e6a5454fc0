"""The ``topology`` command: reports compared with MegatronLayouts built here and with hand-derived groups.

The expected groups come from :class:`MegatronLayout` objects made directly from the spec (rank
offset and local world size per module), never from ``validate_topology``/``build_topology``,
and for the MiMo shape also from the rank arithmetic written out by hand. ``main([...])`` runs
in-process (capsys).
"""

from __future__ import annotations

import io
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from parallel_state_ng.__main__ import main
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.tools.topology.report import parse_spec, place_modules, rank_report
from tests.support.paths import ROOT as ROOT_DIR

SVG = "{http://www.w3.org/2000/svg}"
ROOT = Path(ROOT_DIR)

MIMO = [
    {"name": "encoder", "ranks": [0, 2], "tp": 1},
    {"name": "language", "ranks": [2, 6], "tp": 2, "language": True},
]
COLOCATED = [
    {"name": "vision", "ranks": [0, 8], "tp": 2, "pp": 2},
    {"name": "audio", "ranks": [0, 8], "tp": 4, "order": "tp-cp-ep-pp-dp"},
    {
        "name": "language",
        "ranks": [8, 24],
        "tp": 4,
        "pp": 2,
        "ep": 2,
        "etp": 2,
        "language": True,
        "options": {"distributed_timeout_minutes": 30},
    },
]


def write_spec(tmp_path, modules, name="spec.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(modules, indent=2))
    return str(path)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["topology", *args])
    out, err = capsys.readouterr()
    return code, out, err


def layout_of(module: dict, world_size: int, release: str = "0.19") -> MegatronLayout:
    start, stop = module["ranks"]
    return MegatronLayout(
        world_size=world_size,
        rank_offset=start,
        local_world_size=stop - start,
        tensor_model_parallel_size=module.get("tp", 1),
        pipeline_model_parallel_size=module.get("pp", 1),
        context_parallel_size=module.get("cp", 1),
        expert_model_parallel_size=module.get("ep", 1),
        expert_tensor_parallel_size=module.get("etp"),
        order=module.get("order", "tp-cp-ep-dp-pp"),
        release=release,
    )


def expected_kinds(module: dict, layout: MegatronLayout) -> list[str]:
    kinds = layout.kinds()
    return kinds if module.get("language") else [k for k in kinds if k not in ("embd", "pos_embd")]


def check_json_against_layouts(report: dict, modules: list[dict], world_size: int) -> None:
    assert report["world_size"] == world_size and report["release"] == "0.19"
    assert [m["name"] for m in report["modules"]] == [m["name"] for m in modules]
    for got, spec in zip(report["modules"], modules):
        layout = layout_of(spec, world_size)
        assert got["ranks"] == spec["ranks"] and got["num_ranks"] == spec["ranks"][1] - spec["ranks"][0]
        assert got["language"] is bool(spec.get("language"))
        assert got["sizes"] == {
            "tp": layout.tensor_model_parallel_size,
            "cp": layout.context_parallel_size,
            "dp": layout.data_parallel_size,
            "pp": layout.pipeline_model_parallel_size,
            "ep": layout.expert_model_parallel_size,
            "etp": layout.expert_tensor_parallel_size,
            "edp": layout.expert_data_parallel_size,
        }
        assert got["order"] == spec.get("order", "tp-cp-ep-dp-pp")
        assert got["options"] == spec.get("options", {})
        assert list(got["kinds"]) == expected_kinds(spec, layout)
        for kind, info in got["kinds"].items():
            groups = layout.enumerate(kind)
            assert info["groups"] == groups, (spec["name"], kind)
            assert info["num_groups"] == len(groups)
            assert sorted(r for g in groups for r in g) == list(range(*spec["ranks"])) or kind in ("embd", "pos_embd")


# --------------------------------------------------------------------------- MiMo
def test_mimo_json_matches_layouts_and_hand_derived_groups(capsys, tmp_path):
    code, out, err = run_cli(capsys, write_spec(tmp_path, MIMO), "--release", "0.19", "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    check_json_against_layouts(report, MIMO, 6)
    assert report["language_module"] == "language"
    assert report["spans"] == [{"ranks": [0, 2], "modules": ["encoder"]}, {"ranks": [2, 6], "modules": ["language"]}]
    enc, lang = report["modules"]
    assert enc["colocated_with"] == [] and lang["colocated_with"] == []
    # encoder: tp 1 over ranks 0-1 -> dp 2; language: tp 2 over ranks 2-5 -> dp 2 (tp fastest)
    assert enc["kinds"]["tp"]["groups"] == [[0], [1]]
    assert enc["kinds"]["dp"]["groups"] == [[0, 1]]
    assert "embd" not in enc["kinds"] and "pos_embd" not in enc["kinds"]
    assert lang["kinds"]["tp"]["groups"] == [[2, 3], [4, 5]]
    assert lang["kinds"]["dp"]["groups"] == [[2, 4], [3, 5]]
    assert lang["kinds"]["pp"]["groups"] == [[2], [3], [4], [5]]
    assert lang["kinds"]["embd"]["groups"] == [[2], [3], [4], [5]]
    assert lang["kinds"]["tp_dp_cp"]["groups"] == [[2, 3, 4, 5]]
    assert report["rank"] is None


def test_mimo_text(capsys, tmp_path):
    code, out, err = run_cli(capsys, write_spec(tmp_path, MIMO), "--release", "0.19", "--kinds", "tp,dp,pp,embd")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:4] == [
        "Topology of 6 ranks, 2 modules, megatron-core 0.19 (pure layout math: no processes, no GPUs)",
        "language module: language",
        "  ranks 0..1  encoder",
        "  ranks 2..5  language",
    ]
    enc = lines.index("Module encoder: ranks 0..1 (2 ranks)")
    lang = lines.index("Module language: ranks 2..5 (4 ranks)")
    assert lines[enc + 1] == "  sizes: tp=1 cp=1 dp=2 pp=1 ep=1 etp=1 edp=2 order=tp-cp-ep-dp-pp"
    assert lines[enc + 2] == "  language module: no (no embedding groups)"
    assert lines[lang + 1] == "  sizes: tp=2 cp=1 dp=2 pp=1 ep=1 etp=2 edp=2 order=tp-cp-ep-dp-pp"
    assert lines[lang + 2] == "  language module: yes (embedding groups)"
    encoder_block, language_block = lines[enc:lang], lines[lang:]
    assert "  groups (3 kinds; long lists abbreviated, --full prints all):" in encoder_block  # no embd
    tp = language_block.index("    tp - tensor model parallel [TENSOR_MODEL_PARALLEL_GROUP]: 2 groups of 2 ranks")
    assert language_block[tp + 1 : tp + 3] == ["      0: [2, 3]", "      1: [4, 5]"]
    dp = language_block.index("    dp - data parallel [DATA_PARALLEL_GROUP]: 2 groups of 2 ranks")
    assert language_block[dp + 1 : dp + 3] == ["      0: [2, 4]", "      1: [3, 5]"]
    assert any(line.startswith("    embd - ") for line in language_block)
    assert not any(line.startswith("    embd - ") for line in encoder_block)


def test_mimo_rank_view(capsys, tmp_path):
    spec = write_spec(tmp_path, MIMO)
    code, out, err = run_cli(capsys, spec, "--release", "0.19", "--rank", "3", "--format", "json")
    assert code == 0, err
    view = json.loads(out)["rank"]
    assert view["rank"] == 3 and view["modules"] == ["language"] and list(view["views"]) == ["language"]
    layout = layout_of(MIMO[1], 6)
    groups = view["views"]["language"]["groups"]
    assert list(groups) == layout.kinds()
    for kind, entry in groups.items():
        assert entry["ranks"] == layout.group(kind, 3), kind
        assert entry["ranks"][entry["position"]] == 3
    assert groups["tp"] == {"position": 1, "ranks": [2, 3]} and groups["dp"] == {"position": 0, "ranks": [3, 5]}
    assert view["views"]["language"]["pipeline"] == {
        "stage": 0,
        "stages": 1,
        "first": 3,
        "last": 3,
        "next": 3,
        "prev": 3,
    }

    code, out, _ = run_cli(capsys, spec, "--release", "0.19", "--rank", "1", "--kinds", "tp,dp,pp")
    assert code == 0
    lines = out.splitlines()
    at = lines.index("Rank 1 runs 1 module: encoder")
    assert lines[at + 1 :] == [
        "  encoder:",
        "    dense coordinate:  tp=0 gtp_remat=0 cp=0 ep=0 dp=1 pp=0",
        "    expert coordinate: etp=0 ep=0 egtp_remat=0 edp=1 pp=0",
        "    pipeline: stage 0 of 1; first 1, last 1, next 1, prev 1",
        "    tp  position 0 of 1     [1]",
        "    dp  position 1 of 2     [0, 1]",
        "    pp  position 0 of 1     [1]",
    ]


def test_mimo_svg_blocks(capsys, tmp_path):
    code, out, err = run_cli(capsys, write_spec(tmp_path, MIMO), "--release", "0.19", "--format", "svg", "--rank", "3")
    assert code == 0, err
    root = ET.fromstring(out.encode())
    blocks = [g for g in root.iter(f"{SVG}g") if g.get("class") == "module"]
    assert [(g.get("data-module"), g.get("data-start"), g.get("data-stop")) for g in blocks] == [
        ("encoder", "0", "2"),
        ("language", "2", "6"),
    ]
    assert [g.get("data-language") for g in blocks] == ["false", "true"]
    rects = [g.find(f"{SVG}rect") for g in blocks]
    enc_x, enc_w = float(rects[0].get("x")), float(rects[0].get("width"))
    lang_x, lang_w = float(rects[1].get("x")), float(rects[1].get("width"))
    assert enc_x + enc_w <= lang_x and lang_w > enc_w  # rank order, language holds twice the ranks
    assert rects[0].get("y") == rects[1].get("y")  # disjoint: one lane
    assert rects[0].get("fill") != rects[1].get("fill")
    texts = [" ".join(t.text or "" for t in g.iter(f"{SVG}text")) for g in blocks]
    assert "encoder" in texts[0] and "ranks 0..1 (2)" in texts[0] and "tp=1 cp=1 dp=2 pp=1" in texts[0]
    assert "language" in texts[1] and "ranks 2..5 (4)" in texts[1] and "tp=2 cp=1 dp=2 pp=1" in texts[1]
    markers = [e for e in root.iter(f"{SVG}line") if e.get("class") == "rank-marker"]
    assert [m.get("data-rank") for m in markers] == ["3"]
    assert lang_x < float(markers[0].get("x1")) < lang_x + lang_w


# --------------------------------------------------------------------------- colocated
def test_colocated_json_text_and_rank(capsys, tmp_path):
    spec = write_spec(tmp_path, COLOCATED)
    code, out, err = run_cli(capsys, spec, "--release", "0.19", "--format", "json", "--rank", "5")
    assert code == 0, err
    report = json.loads(out)
    check_json_against_layouts(report, COLOCATED, 24)
    assert report["spans"] == [
        {"ranks": [0, 8], "modules": ["vision", "audio"]},
        {"ranks": [8, 24], "modules": ["language"]},
    ]
    by_name = {m["name"]: m for m in report["modules"]}
    assert by_name["vision"]["colocated_with"] == ["audio"] and by_name["audio"]["colocated_with"] == ["vision"]
    assert by_name["language"]["sizes"]["edp"] == 2  # 16 / (etp 2 x ep 2 x pp 2)
    view = report["rank"]
    assert view["modules"] == ["vision", "audio"]
    for spec_module in COLOCATED[:2]:
        layout = layout_of(spec_module, 24)
        for kind, entry in view["views"][spec_module["name"]]["groups"].items():
            assert entry["ranks"] == layout.group(kind, 5), (spec_module["name"], kind)
    assert view["views"]["vision"]["groups"]["tp"]["ranks"] == [4, 5]
    assert view["views"]["audio"]["groups"]["tp"]["ranks"] == [4, 5, 6, 7]
    assert view["views"]["vision"]["groups"]["pp"]["ranks"] == [1, 5]

    code, out, _ = run_cli(capsys, spec, "--release", "0.19", "--kinds", "tp")
    assert code == 0
    lines = out.splitlines()
    assert "  ranks 0..7   vision + audio (colocated)" in lines
    assert "  ranks 8..23  language" in lines
    assert "Module vision: ranks 0..7 (8 ranks), colocated with audio" in lines
    assert "  options: distributed_timeout_minutes=30" in lines


def test_colocated_svg_stacks_modules(capsys, tmp_path):
    code, out, err = run_cli(capsys, write_spec(tmp_path, COLOCATED), "--release", "0.19", "--format", "svg")
    assert code == 0, err
    root = ET.fromstring(out.encode())
    blocks = {g.get("data-module"): g for g in root.iter(f"{SVG}g") if g.get("class") == "module"}
    assert list(blocks) == ["vision", "audio", "language"]
    extents = {n: (g.get("data-start"), g.get("data-stop"), g.get("data-lane")) for n, g in blocks.items()}
    assert extents == {"vision": ("0", "8", "0"), "audio": ("0", "8", "1"), "language": ("8", "24", "0")}
    rect = {n: g.find(f"{SVG}rect") for n, g in blocks.items()}
    box = {n: tuple(float(r.get(a)) for a in ("x", "y", "width", "height")) for n, r in rect.items()}
    assert box["vision"][0] == box["audio"][0] and box["vision"][2] == box["audio"][2]  # same ranks
    assert box["audio"][1] >= box["vision"][1] + box["vision"][3]  # stacked below
    assert box["language"][0] >= box["vision"][0] + box["vision"][2] and box["language"][1] == box["vision"][1]
    legend = [r.get("data-legend-module") for r in root.iter(f"{SVG}rect") if r.get("class") == "legend"]
    assert legend == ["vision", "audio", "language"]


# --------------------------------------------------------------------------- scale
def test_4096_rank_world_is_fast(capsys, tmp_path):
    modules = [
        {"name": "vision", "ranks": [0, 512], "tp": 4, "pp": 2},
        {"name": "language", "ranks": [512, 4096], "tp": 8, "pp": 4, "cp": 2, "ep": 8, "language": True},
    ]
    spec = write_spec(tmp_path, modules)
    started = time.perf_counter()
    code, out, err = run_cli(capsys, spec, "--release", "0.19", "--rank", "4000")
    assert code == 0, err
    code_json, out_json, _ = run_cli(capsys, spec, "--release", "0.19", "--rank", "4000", "--format", "json")
    code_svg, out_svg, _ = run_cli(capsys, spec, "--release", "0.19", "--format", "svg")
    elapsed = time.perf_counter() - started
    assert code_json == code_svg == 0
    assert elapsed < 15, elapsed  # three runs; about 1 s in all on one core
    lines = out.splitlines()
    assert len(lines) < 400  # abbreviated
    assert "      3582: [4094]" in lines and "            ... 3579 more groups ..." in lines  # gtp_remat of language
    report = json.loads(out_json)
    check_json_against_layouts(report, modules, 4096)
    layout = layout_of(modules[1], 4096)
    groups = report["rank"]["views"]["language"]["groups"]
    for kind, entry in groups.items():
        assert (None if entry is None else entry["ranks"]) == layout.group(kind, 4000), kind
    # local rank 3488 of the language module: pp stride tp 8 x cp 2 x dp 56 = 896 -> the last of 4 stages
    assert groups["pp"] == {"position": 3, "ranks": [1312, 2208, 3104, 4000]}
    assert groups["embd"] == {"position": 1, "ranks": [1312, 4000]} and groups["pos_embd"] is None
    assert len([g for g in ET.fromstring(out_svg.encode()).iter(f"{SVG}g") if g.get("class") == "module"]) == 2


def test_rank_report_is_closed_form(monkeypatch):
    """A 65,536-rank world: the rank view never enumerates a group kind."""
    modules = parse_spec(
        json.dumps(
            [
                {"name": "encoder", "ranks": [0, 1024], "tp": 4},
                {"name": "language", "ranks": [1024, 65536], "tp": 8, "pp": 8, "cp": 2, "ep": 4, "language": True},
            ]
        )
    )
    placements = place_modules(modules, release="0.19")

    def refuse(self, kind):
        raise AssertionError(f"enumerate({kind!r}) called")

    monkeypatch.setattr(MegatronLayout, "enumerate", refuse)
    started = time.perf_counter()
    view = rank_report(placements, 40000)
    assert time.perf_counter() - started < 2
    assert view["modules"] == ["language"]
    assert view["views"]["language"]["groups"]["tp"]["ranks"] == list(range(40000, 40008))
    pipeline = view["views"]["language"]["groups"]["pp"]["ranks"]
    assert len(pipeline) == 8 and 40000 in pipeline and all(1024 <= r < 65536 for r in pipeline)


# --------------------------------------------------------------------------- options and input
def test_stdin_world_size_and_output(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(MIMO)))
    target = tmp_path / "mimo.svg"
    code, out, err = run_cli(
        capsys, "-", "--release", "0.19", "--world-size", "6", "--format", "svg", "-o", str(target)
    )
    assert code == 0 and out == "", err
    assert [g.get("data-module") for g in ET.parse(target).getroot().iter(f"{SVG}g") if g.get("class")] == [
        "encoder",
        "language",
    ]


BAD_SPECS = [
    ("[", "json: not valid JSON (truncated?): Expecting value at line 1 column 2"),
    ('{"name": "language"}', "a topology spec is a non-empty JSON list of modules, got an object"),
    ("[]", "a topology spec is a non-empty JSON list of modules, got an empty list"),
    ("[5]", "modules[0] must be an object with keys"),
    ('[{"name": "language", "ranks": [0, 4], "tpp": 2, "language": true}]', "unknown key(s) ['tpp']"),
    (
        '[{"name": "language", "ranks": [0, 4], "language": true, "language": false}]',
        "json: key 'language' appears twice in one object",
    ),
    ('[{"name": "language", "language": true}]', "missing key(s) ['ranks']"),
    ('[{"name": "language", "ranks": "0-4", "language": true}]', "ranks must be [start, stop]"),
    (
        '[{"name": "language", "ranks": [0, 4], "language": true, "options": {"get_embedding_ranks": 1}}]',
        "option(s) ['get_embedding_ranks'] cannot be set in a spec file",
    ),
    (
        '[{"name": "language", "ranks": [0, 4], "tp": 3, "language": true}]',
        "invalid topology: module 'language': its 4 ranks (0..3) are not divisible by tensor (3)",
    ),
    ('[{"name": "a", "ranks": [0, 4]}]', "invalid topology: a topology needs exactly one language module"),
    (
        '[{"name": "a", "ranks": [0, 4], "language": true}, {"name": "a", "ranks": [4, 8]}]',
        "invalid topology: module names must be unique; repeated: ['a']",
    ),
    (
        '[{"name": "a", "ranks": [0, 4], "language": true}, {"name": "b", "ranks": [2, 6]}]',
        "invalid topology: modules 'a' (ranks 0..3) and 'b' (ranks 2..5) overlap without being colocated",
    ),
    ('[{"name": "a", "ranks": [2, 4], "language": true}]', "invalid topology: ranks 0..1 of the world of 4"),
    ('[{"name": "a", "ranks": [0, 4], "language": "yes"}]', "invalid topology: module 'a': language must be a bool"),
    ('[{"name": "a", "ranks": [0, 4], "tp": "2", "language": true}]', "tensor_model_parallel_size must be an int"),
]


@pytest.mark.parametrize("text,message", BAD_SPECS, ids=[f"bad{i}" for i in range(len(BAD_SPECS))])
def test_bad_spec_exits_2_with_message(capsys, tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    code, out, err = run_cli(capsys, str(path), "--release", "0.19")
    assert code == 2 and out == ""
    assert err.startswith("parallel-state-ng topology: error: ") and err.count("\n") == 1
    assert message in err, err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--release", "0.16"], "megatron-core 0.16 cannot place a module on part of the world"),
        (["--release", "banana"], "argument --release: cannot read a megatron-core release from 'banana'"),
        (["--release", "0.19", "--rank", "6"], "argument --rank: rank 6 is out of range for a world of 6 ranks"),
        (["--release", "0.19", "--kinds", "tp,xx"], "argument --kinds: unknown group kind(s) ['xx']"),
        (["--release", "0.19", "--world-size", "8"], "ranks 6..7 of the world of 8 belong to no module"),
    ],
)
def test_bad_options_exit_2(capsys, tmp_path, args, message):
    code, out, err = run_cli(capsys, write_spec(tmp_path, MIMO), *args)
    assert code == 2 and out == ""
    assert message in err, err


def test_missing_spec_file(capsys, tmp_path):
    code, out, err = run_cli(capsys, str(tmp_path / "nope.json"))
    assert code == 2 and out == ""
    assert "argument SPEC: cannot read" in err and "No such file or directory" in err


# --------------------------------------------------------------------------- docs
def test_docs_picture_and_spec_are_current(capsys):
    """docs/topology.svg is what the tool draws for docs/mimo_topology.json.

    The text report shown in docs/tools.md is run and compared by tests/docs/test_docs_blocks.py.
    """
    spec = str(ROOT / "docs" / "mimo_topology.json")
    assert json.loads(Path(spec).read_text()) == MIMO
    code, out, err = run_cli(capsys, spec, "--release", "0.19", "--format", "svg")
    assert code == 0, err
    assert out == (ROOT / "docs" / "topology.svg").read_text(encoding="utf-8")
