"""scripts/examples/demo.py: the real 8-process run (default and a non-default order), its option
errors, and its verdict when a rank sees the wrong members.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from scripts.examples import demo
from tests.support.paths import ROOT

KIND_LINE = re.compile(
    r"^(?P<label>[^\[]+) \[(?P<dims>[a-z-]+)(?P<view> in the expert view)?\]: (?P<n>\d+) groups? of (?P<m>\d+)$"
)
GROUP = re.compile(r"\[(\d+(?:, \d+)*)\]")


def _run_demo(*options: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "scripts.examples", "demo", *options],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _parse_groups(stdout: str) -> dict[tuple[bool, str], list[list[int]]]:
    """{(expert view?, dims): groups} from the demo's report."""
    lines = stdout.splitlines()
    out = {}
    i = 0
    while i < len(lines):
        match = KIND_LINE.match(lines[i])
        i += 1
        if not match:
            continue
        groups = []
        while i < len(lines) and lines[i].startswith("  ["):
            groups += [[int(x) for x in g.split(", ")] for g in GROUP.findall(lines[i])]
            i += 1
        assert len(groups) == int(match["n"]) and all(len(g) == int(match["m"]) for g in groups)
        out[(bool(match["view"]), match["dims"])] = groups
    return out


def _assert_megatron_groups(parsed, *, tp, dp, pp, ep, etp, dense_order, expert_order, kinds):
    """Every printed kind equals megatron's RankGenerator groups (cp 1); ``kinds`` are the
    expected (expert view?, dims) keys.
    """
    megatron_ps = pytest.importorskip("megatron.core.parallel_state")
    world = tp * dp * pp
    dense = megatron_ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=dense_order)
    expert = megatron_ps.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=expert_order)
    to_token = {"etp": "tp", "edp": "dp"}
    assert sorted(parsed) == sorted(kinds)
    for (in_expert_view, dims), groups in parsed.items():
        generator = expert if in_expert_view else dense
        token = "-".join(to_token.get(d, d) for d in dims.split("-"))
        assert groups == generator.get_ranks(token), (in_expert_view, dims)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_default_run_verifies_every_group():
    result = _run_demo()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "parallel_state_ng demo: 8 CPU processes, gloo on this machine"
    assert lines[1].startswith("dense layout:  tp=2 dp=2 pp=2  (order tp-dp-pp")
    assert lines[2].startswith("expert layout: etp=2 ep=2 edp=1 pp=2  (order etp-ep-edp-pp")
    assert lines[3].startswith("5 of Megatron-Core's 14 kinds left out")  # cp and edp have size 1
    assert "tensor parallel [tp]: 4 groups of 2" in lines
    assert "  [0, 1] [2, 3] [4, 5] [6, 7]" in lines
    assert "pipeline parallel [pp]: 4 groups of 2" in lines
    assert "  [0, 4] [1, 5] [2, 6] [3, 7]" in lines
    assert lines[-1].startswith("all 27 groups verified")
    # exactly megatron's groups (its expert generator needs ep in the order: before dp, as the demo says)
    kinds = [(False, "tp"), (False, "dp"), (False, "pp"), (False, "tp-pp"), (False, "tp-dp")]
    kinds += [(True, "etp"), (True, "ep"), (True, "etp-ep"), (True, "etp-ep-pp")]
    _assert_megatron_groups(
        _parse_groups(result.stdout),
        tp=2,
        dp=2,
        pp=2,
        ep=2,
        etp=2,
        dense_order="tp-dp-pp",
        expert_order="tp-ep-dp-pp",
        kinds=kinds,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.rotating(4, 10)  # end-to-end part 5 of 10 (docs/testing.md, "Rotating parts")
def test_non_default_options():
    """Tp 1 (left out of the order) and pipeline fastest: a world of 4 processes."""
    result = _run_demo("--tp", "1", "--order", "pp-dp")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "parallel_state_ng demo: 4 CPU processes, gloo on this machine"
    assert lines[1].startswith("dense layout:  pp=2 dp=2  (order pp-dp")
    assert lines[2].startswith("expert layout: pp=2 ep=2 edp=1 etp=1  (order pp-ep-edp-etp")
    assert "pipeline parallel [pp]: 2 groups of 2" in lines
    assert lines[lines.index("pipeline parallel [pp]: 2 groups of 2") + 1] == "  [0, 1] [2, 3]"
    assert lines[-1].startswith("all 7 groups verified")
    kinds = [(False, "dp"), (False, "pp"), (True, "ep"), (True, "ep-pp")]
    _assert_megatron_groups(
        _parse_groups(result.stdout),
        tp=1,
        dp=2,
        pp=2,
        ep=2,
        etp=1,
        dense_order="pp-dp",
        expert_order="pp-ep-dp",
        kinds=kinds,
    )


@pytest.mark.parametrize(
    "order,dense,expert,megatron_order",
    [
        # ep left out: placed before dp, where MCore's default order tp-cp-ep-dp-pp has it
        ("tp-dp-pp", ["tp", "dp", "pp"], ["etp", "ep", "edp", "pp"], "tp-ep-dp-pp"),
        ("tp-cp-ep-dp-pp", ["tp", "cp", "dp", "pp"], ["etp", "ep", "edp", "pp"], "tp-cp-ep-dp-pp"),
        ("pp-tp-ep-dp", ["pp", "tp", "dp"], ["pp", "etp", "ep", "edp"], "pp-tp-ep-dp"),
        ("ep-tp-dp-pp", ["tp", "dp", "pp"], ["ep", "etp", "edp", "pp"], "ep-tp-dp-pp"),
        ("tp-dp-pp-ep", ["tp", "dp", "pp"], ["etp", "edp", "pp", "ep"], "tp-dp-pp-ep"),
    ],
)
def test_orders_of_the_dense_and_expert_layouts(order, dense, expert, megatron_order):
    """The expert layout follows --order, as Megatron-Core's expert generator does."""
    megatron_ps = pytest.importorskip("megatron.core.parallel_state")
    options = ["--order", order, "--etp", "1"] + (["--pp", "1"] if order.endswith("ep") else [])
    config = demo.make_config(demo.build_parser().parse_args(options))
    assert config.dense_order == dense and config.expert_order == expert
    s = config.sizes
    mcore = megatron_ps.RankGenerator(tp=s["etp"], ep=s["ep"], dp=s["edp"], pp=s["pp"], cp=1, order=megatron_order)
    from parallel_state_ng import Layout

    layout = Layout(config.expert_shape, config.expert_order)
    for token in ("ep", "tp-ep", "dp", "pp"):
        assert layout.rank_enum([{"tp": "etp", "dp": "edp"}.get(t, t) for t in token.split("-")]) == mcore.get_ranks(
            token
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "options,message",
    [
        (["--tp", "0"], "argument --tp: expected a positive integer, got 0"),
        (["--order", "tp-pp"], "--order 'tp-pp' leaves out dp (size 2)"),
        (["--order", "tp-xx-dp-pp"], "unknown token(s) ['xx']"),
        (["--world-size", "4"], "--world-size 4 is smaller than the grid: tp*cp*dp*pp = 8"),
        (["--ep", "3"], "etp*ep*pp = 2*3*2 = 12 does not divide the grid's 8 ranks"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(options, message):
    result = _run_demo(*options, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_report_fails_when_a_rank_sees_the_wrong_members(monkeypatch):
    config = demo.make_config(demo.build_parser().parse_args(["--world-size", "9"]))
    monkeypatch.setenv("WORLD_SIZE", "9")
    from parallel_state_ng import HyperCommGrid

    grid = HyperCommGrid(config.dense_shape, config.dense_order)
    grid.register_view("expert", config.expert_shape, config.expert_order, shared_dims=config.shared_dims)
    seen = [
        [sorted(grid.group_ranks(dims, rank, view=view)) if rank < 8 else None for _, view, dims in config.kinds]
        for rank in range(9)
    ]
    report, ok = demo._report(config, grid, seen)
    assert ok and report.splitlines()[-1].startswith("all 27 groups verified")
    assert "rank 8 is outside the grid" in report

    seen[3][0] = [2, 3, 4]  # rank 3's tensor-parallel all-reduce reached a stranger
    report, ok = demo._report(config, grid, seen)
    assert not ok
    assert "FAILED tensor parallel: rank 3 expected [2, 3], its all-reduce reached [2, 3, 4]" in report
    assert report.splitlines()[-1] == "23 of 27 groups verified; 1 check(s) failed"
