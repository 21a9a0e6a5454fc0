"""The ``layout`` command: reports compared with MegatronLayout and brute-force node math.

``main([...])`` runs in-process (capsys); one smoke test runs ``python -m parallel_state_ng``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from parallel_state_ng.__main__ import main
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.tools.common import format_ranks
from tests.support.paths import ROOT
from tests.support.served import served_facts, skip_unless

# (CLI options, MegatronLayout keyword arguments, gpus per node)
CONFIGS = [
    (
        ["--world-size", "64", "--tp", "4", "--pp", "2", "--cp", "2", "--ep", "2"],
        dict(
            world_size=64,
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=2,
            context_parallel_size=2,
            expert_model_parallel_size=2,
        ),
        8,
    ),
    (
        ["--world-size", "48", "--tp", "2", "--pp", "3", "--ep", "2", "--etp", "1", "--order", "tp-ep-pp-dp"],
        dict(
            world_size=48,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=3,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            order="tp-ep-pp-dp",
        ),
        4,
    ),
    (
        ["--world-size", "32", "--tp", "2", "--cp", "4", "--hcp-sizes", "2,2", "--num-dist-opt-instances", "2"],
        dict(
            world_size=32,
            tensor_model_parallel_size=2,
            context_parallel_size=4,
            hierarchical_context_parallel_sizes=[2, 2],
            num_distributed_optimizer_instances=2,
        ),
        16,
    ),
    (
        ["--world-size", "24", "--tp", "3", "--pp", "4", "--order", "pp-tp-dp"],
        dict(world_size=24, tensor_model_parallel_size=3, pipeline_model_parallel_size=4, order="pp-tp-dp"),
        6,
    ),
]
IDS = ["tp4pp2cp2ep2", "order-tp-ep-pp-dp", "hcp+dist-opt", "pp-first"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["layout", *args])
    out, err = capsys.readouterr()
    return code, out, err


def brute_locality(groups: list[list[int]], gpus: int) -> dict[str, int]:
    spans = []
    for members in groups:
        nodes = []
        for r in members:
            if r // gpus not in nodes:
                nodes.append(r // gpus)
        spans.append(len(nodes))
    return {
        "num_groups": len(groups),
        "min_nodes": min(spans),
        "max_nodes": max(spans),
        "crossing_groups": len([s for s in spans if s != 1]),
    }


@pytest.mark.parametrize("cli,kwargs,gpus", CONFIGS, ids=IDS)
def test_json_matches_megatron_layout(capsys, cli, kwargs, gpus):
    layout = MegatronLayout(**kwargs)
    rank = layout.world_size - 3
    code, out, err = run_cli(capsys, *cli, "--gpus-per-node", str(gpus), "--rank", str(rank), "--format", "json")
    assert code == 0, err
    output = json.loads(out)
    report = output["report"]  # the report's part; the snapshot's part is output["kinds"] etc.

    cfg = report["config"]
    assert (cfg["tp"], cfg["pp"], cfg["cp"], cfg["dp"]) == (
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.context_parallel_size,
        layout.data_parallel_size,
    )
    assert (cfg["ep"], cfg["etp"], cfg["edp"]) == (
        layout.expert_model_parallel_size,
        layout.expert_tensor_parallel_size,
        layout.expert_data_parallel_size,
    )
    assert cfg["num_nodes"] == layout.world_size // gpus

    assert list(report["kinds"]) == list(output["kinds"]) == layout.kinds()
    for kind in layout.kinds():
        groups = layout.enumerate(kind)
        assert output["kinds"][kind]["groups"] == groups, kind
        assert report["kinds"][kind]["num_groups"] == len(groups)
        assert report["locality"][kind] == brute_locality(groups, gpus), kind

    view = report["rank"]
    assert view["rank"] == rank and view["node"] == rank // gpus
    for kind in layout.kinds():
        members = layout.group(kind, rank)
        if members is None:
            assert view["groups"][kind] is None
        else:
            assert view["groups"][kind]["ranks"] == members
            assert members[view["groups"][kind]["position"]] == rank
    pipeline = layout.group("pp", rank)
    i = pipeline.index(rank)
    assert view["pipeline"] == {
        "stage": i,
        "stages": len(pipeline),
        "first": pipeline[0],
        "last": pipeline[-1],
        "next": pipeline[(i + 1) % len(pipeline)],
        "prev": pipeline[(i - 1) % len(pipeline)],
    }
    assert layout.decoder.rank(view["dense_coord"]) == rank


@pytest.mark.parametrize("cli,kwargs,gpus", CONFIGS, ids=IDS)
def test_text_full_lists_every_group(capsys, cli, kwargs, gpus):
    layout = MegatronLayout(**kwargs)
    code, out, err = run_cli(capsys, *cli, "--gpus-per-node", str(gpus), "--full")
    assert code == 0, err
    header = out.splitlines()[1]
    assert header == (
        f"sizes: tp={layout.tensor_model_parallel_size} pp={layout.pipeline_model_parallel_size} "
        f"cp={layout.context_parallel_size} dp={layout.data_parallel_size} ep={layout.expert_model_parallel_size} "
        f"etp={layout.expert_tensor_parallel_size} edp={layout.expert_data_parallel_size} order={layout.order}"
    )
    lines = set(out.splitlines())
    for kind in layout.kinds():
        groups = layout.enumerate(kind)
        width = len(str(len(groups) - 1))
        for index, members in enumerate(groups):
            assert f"    {index:>{width}}: {members}" in lines, (kind, index)


def test_text_rank_view_and_kinds_filter(capsys):
    layout = MegatronLayout(64, 4, 2, 2, 2)
    code, out, _ = run_cli(
        capsys,
        "--world-size",
        "64",
        "--tp",
        "4",
        "--pp",
        "2",
        "--cp",
        "2",
        "--ep",
        "2",
        "--rank",
        "13",
        "--kinds",
        "tp,pp,embd",
    )
    assert code == 0
    assert "Rank 13 (node 1):" in out
    gtp = " gtp_remat=0" if layout.facts.gtp_remat_axis else ""  # 0.19's GTP axis, size 1
    assert f"  dense coordinate:  tp=1{gtp} cp=1 ep=0 dp=1 pp=0" in out
    assert "  pipeline: stage 0 of 2; first 13, last 45, next 45, prev 45" in out
    assert "  tp    position 1 of 4  [12, 13, 14, 15]" in out
    kinds_listed = [line.split(" - ")[0] for line in out.splitlines() if " - " in line and line[0] != " "]
    assert kinds_listed == ["tp", "pp", "embd"]
    assert layout.group("tp", 13) == [12, 13, 14, 15]


def test_text_abbreviates_big_worlds(capsys):
    code, out, _ = run_cli(capsys, "--world-size", "65536", "--tp", "8", "--pp", "4", "--cp", "2", "--ep", "8")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) < 200
    assert "... 8187 more groups ..." in [line.strip() for line in lines]  # tp: 8192 groups, 5 shown
    assert "    8191: [65528, 65529, 65530, 65531, 65532, 65533, 65534, 65535]" in lines
    assert "    0: [0, 1, 2, ..., 16383] (16384 ranks, step 1)" in lines  # tp_dp_cp


def test_format_ranks():
    assert format_ranks([1, 5, 9]) == "[1, 5, 9]"
    assert format_ranks(list(range(3, 3 + 4 * 40, 4))) == "[3, 7, 11, ..., 159] (40 ranks, step 4)"
    irregular = list(range(8)) + list(range(100, 120))
    assert format_ranks(irregular) == "[0, 1, 2, 3, 4, 5, 6, 7, ..., 118, 119] (28 ranks)"
    assert format_ranks(irregular, full=True) == str(irregular)


def _crosses(groups: list[list[int]], gpus: int) -> bool:
    return any(len({r // gpus for r in g}) > 1 for g in groups)


@pytest.mark.parametrize(
    "world,tp,etp,ep,order,gpus",
    [
        (32, 4, None, 1, "tp-cp-ep-dp-pp", 8),
        (32, 4, None, 1, "tp-cp-ep-dp-pp", 2),
        (32, 2, None, 1, "dp-tp-pp", 8),
        (32, 2, 4, 2, "tp-cp-ep-dp-pp", 4),
        (32, 2, 4, 2, "tp-cp-ep-dp-pp", 2),
        (24, 3, None, 1, "tp-dp", 4),
        (24, 3, None, 1, "tp-dp", 6),
        (16, 1, None, 1, "tp-cp-ep-dp-pp", 1),
    ],
)
def test_warning_exactly_when_tensor_groups_cross_nodes(capsys, world, tp, etp, ep, order, gpus):
    layout = MegatronLayout(world, tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order)
    args = [
        "--world-size",
        str(world),
        "--tp",
        str(tp),
        "--ep",
        str(ep),
        "--order",
        order,
        "--gpus-per-node",
        str(gpus),
    ]
    if etp is not None:
        args += ["--etp", str(etp)]
    code, out, _ = run_cli(capsys, *args, "--kinds", "dp")
    assert code == 0
    tp_cross = _crosses(layout.enumerate("tp"), gpus)
    etp_cross = _crosses(layout.enumerate("ep_tp"), gpus)
    assert ("WARNING: tensor-parallel groups (tp," in out) == tp_cross
    assert ("WARNING: expert tensor-parallel groups (ep_tp," in out) == etp_cross
    assert ("stay inside nodes" in out) == (not tp_cross and not etp_cross)
    code, out, _ = run_cli(capsys, *args, "--format", "json")
    assert len(json.loads(out)["report"]["warnings"]) == tp_cross + etp_cross


@pytest.mark.parametrize(
    "cli,kwargs,kind,gpus",
    [
        (
            ["--world-size", "32", "--tp", "4", "--pp", "2", "--cp", "2"],
            dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, context_parallel_size=2),
            "tp",
            8,
        ),
        (
            ["--world-size", "32", "--tp", "4", "--pp", "2", "--cp", "2"],
            dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, context_parallel_size=2),
            "cp",
            8,
        ),
        (
            ["--world-size", "48", "--tp", "2", "--pp", "4", "--order", "tp-pp-dp"],
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, order="tp-pp-dp"),
            "embd",
            4,
        ),
        (
            ["--world-size", "64", "--tp", "2", "--ep", "4", "--etp", "1"],
            dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
            "ep",
            16,
        ),
        (["--world-size", "12", "--tp", "3"], dict(tensor_model_parallel_size=3), "dp", 12),
    ],
    ids=["tp", "cp", "embd-with-gaps", "ep", "one-node"],
)
def test_svg_cells(capsys, tmp_path, cli, kwargs, kind, gpus):
    out_file = tmp_path / "layout.svg"
    code = main(
        [
            "layout",
            *cli,
            "--gpus-per-node",
            str(gpus),
            "--format",
            "svg",
            "--color-kind",
            kind,
            "--rank",
            "5",
            "--output",
            str(out_file),
        ]
    )
    assert code == 0
    assert capsys.readouterr().out == ""
    root = ET.parse(out_file).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    world = int(cli[1])
    layout = MegatronLayout(world, **kwargs)
    groups = layout.enumerate(kind)
    owner = {r: i for i, g in enumerate(groups) for r in g}
    cells = [el for el in root.iter("{http://www.w3.org/2000/svg}rect") if "data-rank" in el.attrib]
    assert sorted(int(c.get("data-rank")) for c in cells) == list(range(world))
    fills: dict[str, str] = {}
    for cell in cells:
        rank = int(cell.get("data-rank"))
        assert int(cell.get("data-node")) == rank // gpus
        expected = str(owner[rank]) if rank in owner else "none"
        assert cell.get("data-group") == expected
        if rank in owner:  # one colour per group
            assert fills.setdefault(expected, cell.get("fill")) == cell.get("fill")
    assert len(set(fills.values())) == len(fills)
    node_labels = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {f"node {n}" for n in range(world // gpus)} <= node_labels
    legend = [el for el in root.iter("{http://www.w3.org/2000/svg}rect") if "data-legend-group" in el.attrib]
    assert len(legend) == min(len(groups), 64)
    highlighted = [c for c in cells if c.get("data-rank") == "5"]
    assert highlighted[0].get("stroke-width") == "3"


def test_output_file_matches_stdout(capsys, tmp_path):
    args = ["--world-size", "16", "--tp", "2", "--pp", "2", "--rank", "3"]
    code, out, _ = run_cli(capsys, *args)
    target = tmp_path / "report.txt"
    assert main(["layout", *args, "--output", str(target)]) == 0
    assert target.read_text() == out
    assert code == 0


@pytest.mark.parametrize(
    "args,option",
    [
        (["--world-size", "64", "--tp", "3"], "--tp"),
        (["--world-size", "64", "--tp", "0"], "--tp"),
        (["--world-size", "sixty"], "--world-size"),
        (["--tp", "2"], "--world-size"),
        (["--world-size", "64", "--ep", "3"], "--ep"),
        (["--world-size", "64", "--order", "tp-xx-dp"], "--order"),
        (["--world-size", "64", "--order", "tp-dp-dp"], "--order"),
        (["--world-size", "64", "--pp", "2", "--order", "tp-dp"], "--order"),
        (["--world-size", "64", "--num-dist-opt-instances", "3"], "--num-dist-opt-instances"),
        (["--world-size", "64", "--cp", "4", "--hcp-sizes", "2,3"], "--hcp-sizes"),  # product 6, not 4
        (["--world-size", "64", "--cp", "4", "--hcp-sizes", "2,0"], "--hcp-sizes"),
        (["--world-size", "64", "--rank", "64"], "--rank"),
        (["--world-size", "64", "--rank", "-1"], "--rank"),
        (["--world-size", "64", "--kinds", "tp,bogus"], "--kinds"),
        (["--world-size", "64", "--gpus-per-node", "6"], "--gpus-per-node"),
        (["--world-size", "64", "--format", "svg", "--color-kind", "bogus"], "--color-kind"),
        (["--world-size", "2048", "--format", "svg"], "--world-size"),
        (["--world-size", "64", "--format", "pdf"], "--format"),
    ],
)
def test_bad_input_exits_2_naming_the_option(capsys, args, option):
    if "2,3" in args:  # the layout follows the served release, and 0.12 takes any product
        skip_unless(served_facts().hcp_sizes_checked, "does not check the product of hierarchical CP sizes")
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    assert out == ""
    assert option in err
    assert "Traceback" not in err


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with ``args``, from the repository root, which it can import."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_module_entry_point_smoke():
    proc = _python("-m", "parallel_state_ng", "layout", "--world-size", "8", "--tp", "2", "--kinds", "tp")
    assert proc.returncode == 0, proc.stderr
    assert "tp - tensor model parallel [TENSOR_MODEL_PARALLEL_GROUP]: 4 groups of 2 ranks" in proc.stdout
    bad = _python("-m", "parallel_state_ng", "layout", "--world-size", "8", "--tp", "3")
    assert bad.returncode == 2 and "--tp" in bad.stderr and "Traceback" not in bad.stderr


# The commands that are pure layout math, run in one fresh interpreter that then reports whether
# torch was imported (``--share`` counts communicators through the group layer, which needs it).
_PURE_COMMANDS = [
    ["layout", "--world-size", "64", "--tp", "4", "--pp", "2", "--cp", "2", "--ep", "2", "--rank", "13"],
    ["layout", "--world-size", "8", "--tp", "2", "--pp", "2", "--format", "json"],
    [
        "layout",
        "--world-size",
        "16",
        "--tp",
        "2",
        "--pp",
        "2",
        "--cp",
        "2",
        "--diff",
        "--release",
        "0.13",
        "--against",
        "0.16",
    ],
    [
        "layout",
        "--world-size",
        "144",
        "--tp",
        "2",
        "--pp",
        "3",
        "--ep",
        "16",
        "--etp",
        "1",
        "--nvlink-domain-size",
        "72",
    ],
    ["topology", os.path.join(ROOT, "docs", "mimo_topology.json"), "--release", "0.19", "--rank", "3"],
    ["port", "--upgrade", "0.13:0.16", os.path.join(ROOT, "scripts", "examples")],
]


@pytest.mark.multiprocess
def test_pure_commands_do_not_import_torch():
    code = (
        "import contextlib, io, json, sys\n"
        "from parallel_state_ng.__main__ import main\n"
        "codes = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        codes.append(main(argv))\n"
        "print(json.dumps({'codes': codes, 'torch': sorted(m for m in sys.modules if m.split('.')[0] == 'torch')}))\n"
    )
    proc = _python("-c", code, json.dumps(_PURE_COMMANDS))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 1, 0, 0, 0]  # --diff: 1 when the releases differ
    assert result["torch"] == []
