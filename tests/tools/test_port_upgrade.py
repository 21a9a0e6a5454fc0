"""``port PATH --upgrade FROM:TO`` on a tree written to tmp_path, checked against the releases' own modules.

The sample is 0.13-era code; every line that uses ``megatron.core.parallel_state`` carries a
``# breaks: <kind>[, <kind>]`` or ``# fine`` marker for the move to 0.19. The report must list
exactly the marked lines with their kinds, the summary must count them, the exit status must be 1.

Then the report is checked against megatron-core 0.13.1's and 0.19.2's real ``parallel_state``
(one process each, ``tests.support.releases.wheels.run_in_release``): every call of the sample is bound
with ``inspect.signature(real_fn).bind`` in both releases, and a call's meaning changes (function
gone, binding refused, an argument bound to another parameter, a default it relies on changed)
exactly on the lines the report names; every fixed call the report proposes binds in 0.19 to the
parameters the original call had in 0.13; removed functions / globals are absent in 0.19's module.
In 0.19's process every call is also bound through ``compat.parallel_state`` serving 0.19.2 (the
same data the check reads): identical bindings, identical names.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from parallel_state_ng.__main__ import main
from parallel_state_ng.releases import parse_release
from parallel_state_ng.tools.port.upgrade import KINDS, check_file
from tests.support.releases import wheels

FROM, TO = "0.13.1", "0.19.2"

STEP = '''\
"""A 0.13-era training step."""
import torch
from megatron.core import parallel_state as mpu
from megatron.core.parallel_state import get_data_parallel_group, is_inside_encoder  # breaks: removed function
from megatron.core.parallel_state import get_tensor_and_data_parallel_group as tdp


def setup():
    mpu.initialize_model_parallel(2, 2, None, None, "nccl")  # breaks: positional shift, removed init argument
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, encoder_tensor_model_parallel_size=1)  # breaks: removed init argument
    mpu.initialize_model_parallel(2, 2, order="tp-cp-ep-dp-pp")  # fine


def step(flag):
    tp = mpu.get_tensor_model_parallel_group()  # fine
    dp = get_data_parallel_group(True, True)  # breaks: positional shift
    dp_cp = get_data_parallel_group(with_context_parallel=True)  # fine
    tdp_cp = tdp(True)  # breaks: positional shift
    first = mpu.is_pipeline_first_stage(ignore_virtual=False)  # fine
    ranks = mpu.default_embedding_ranks([0, 1], split_rank=1)  # breaks: removed keyword
    edp = mpu.get_data_modulo_expert_parallel_group(partial_expert_data_parallel=flag)  # breaks: removed function
    fresh = mpu.is_unitialized()  # breaks: removed function
    enc = is_inside_encoder()  # breaks: removed function
    split = mpu._PIPELINE_MODEL_PARALLEL_SPLIT_RANK  # breaks: removed global
    stages = mpu._PIPELINE_GLOBAL_RANKS  # fine
    return tp, dp, dp_cp, tdp_cp, first, ranks, edp, fresh, enc, split, stages, torch
'''
CLEAN = """\
from megatron.core import parallel_state

def ranks():
    return parallel_state.get_data_parallel_group(with_context_parallel=True), parallel_state.get_tensor_model_parallel_rank()
"""
ALIASES = {"tdp": "get_tensor_and_data_parallel_group"}
REPLACED = {
    "get_data_modulo_expert_parallel_group": "get_expert_data_parallel_group",
    "is_unitialized": "not is_initialized()",
}


def _markers(source: str) -> dict[int, list[str]]:
    out = {}
    for number, line in enumerate(source.splitlines(), 1):
        found = re.search(r"# (breaks: (.*)|fine)$", line)
        if found:
            out[number] = [k.strip() for k in found.group(2).split(",")] if found.group(2) else []
    return out


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "step.py").write_text(STEP)
    (tmp_path / "pkg" / "clean.py").write_text(CLEAN)
    return tmp_path


def _report(path: Path, spec: str, capsys) -> tuple[int, list[str], str]:
    status = main(["port", str(path), "--upgrade", spec])
    out = capsys.readouterr().out.strip().splitlines()
    old, new = (".".join(v.split(".")[:2]) for v in spec.split(":"))
    # the last line points at the layout diff of the same releases (test_upgrade_points_at_layout_diff)
    assert out[-1].endswith(f"layout --world-size 8 --tp 2 --pp 2 --diff --release {old} --against {new}")
    return status, out[:-2], out[-2]


def test_upgrade_report_lines_kinds_and_summary(tree, capsys):
    status, lines, summary = _report(tree, "0.13:0.19", capsys)
    assert status == 1
    step = tree / "pkg" / "step.py"
    expected = Counter((n, kind) for n, kinds in _markers(STEP).items() for kind in kinds)
    findings = check_file(str(step), parse_release("0.13"), parse_release("0.19")).findings
    assert Counter((f.line, f.kind) for f in findings) == expected
    assert lines == [f.format() for f in findings]  # the clean file reports nothing
    assert all(line.startswith(f"{step}:") for line in lines)
    by_kind = Counter(kind for kinds in _markers(STEP).values() for kind in kinds)
    counts = ", ".join(f"{k}: {by_kind[k]}" for k in KINDS if by_kind[k])
    assert summary == (
        f"upgrade 0.13 -> 0.19: scanned 3 files, 19 uses of megatron.core.parallel_state in 2 files: "
        f"{sum(by_kind.values())} break ({counts})"
    )
    text = "\n".join(lines)
    # the fixes: keyword form with 0.13's names, replacements, "removed, no equivalent"
    assert (
        f"{step}:16: get_data_parallel_group(True, True): argument 2 (partial_data_parallel) lands on with_gtp_remat "
        f"in 0.19 -> get_data_parallel_group(True, partial_data_parallel=True)" in lines
    )
    assert (
        f"{step}:18: tdp(True): argument 1 (with_context_parallel) lands on check_initialized in 0.19 -> "
        f"tdp(with_context_parallel=True)" in lines
    )
    for name, replacement in REPLACED.items():
        assert f"{name} does not exist in 0.19 -> use {replacement}" in text
    assert (
        f"{step}:23: is_inside_encoder(): is_inside_encoder does not exist in 0.19 -> removed, no equivalent" in lines
    )
    assert (
        "encoder_tensor_model_parallel_size does not exist in 0.19 -> removed, no equivalent: drop it "
        "(mpu.initialize_model_parallel(tensor_model_parallel_size=2))" in text
    )


def test_no_break_and_downgrade_and_bad_spec(tree, capsys):
    status, lines, summary = _report(tree / "pkg" / "clean.py", "0.13:0.19", capsys)
    assert (status, lines) == (0, []) and summary.endswith("in 1 file: nothing breaks")
    # downgrade 0.19 -> 0.14 of the clean file: still fine; 0.13 -> 0.12 of the sample: one keyword 0.12 lacks
    assert _report(tree / "pkg" / "clean.py", "0.19:0.14", capsys)[0] == 0
    status, lines, summary = _report(tree, "0.13.1:0.12.3", capsys)
    assert (
        status == 1 and summary.startswith("downgrade 0.13.1 -> 0.12.3:") and "1 break (removed keyword: 1)" in summary
    )
    assert lines == [
        f"{tree / 'pkg' / 'step.py'}:21: mpu.get_data_modulo_expert_parallel_group(partial_expert_data_parallel=flag): "
        "keyword partial_expert_data_parallel does not exist in 0.12.3 -> not in 0.12.3, no equivalent: drop it "
        "(mpu.get_data_modulo_expert_parallel_group())"
    ]
    for spec, message in (
        ("0.11:0.19", "not a release the data knows"),
        ("0.19", "expected FROM:TO"),
        ("x:0.19", "is not a megatron-core release"),
    ):
        assert main(["port", str(tree), "--upgrade", spec]) == 2
        assert "argument --upgrade: " in (err := capsys.readouterr().err) and message in err
    assert main(["port", str(tree), "--upgrade", "0.13:0.19", "--rewrite"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


# --------------------------------------------------------------------------- real signatures
def real_bindings(calls: list, names: list, through_compat: bool = False) -> dict:
    """In a release's process: bind each ``[name, args, kwargs]`` to the real function; which names exist.

    ``through_compat``: also bind them to ``compat.parallel_state`` (serving this release).
    """
    import megatron.core.parallel_state as ps

    result = {"calls": _bind_all(ps, calls), "names": {n: hasattr(ps, n) for n in names}}
    if through_compat:
        import compat.parallel_state as cps

        result["compat"] = {
            "served": cps.MEGATRON_VERSION,
            "calls": _bind_all(cps, calls),
            "names": {n: hasattr(cps, n) for n in names},
        }
    return result


def _bind_all(ps, calls: list) -> list:
    out = []
    for name, args, kwargs in calls:
        fn = getattr(ps, name, None)
        if fn is None:
            out.append(None)
            continue
        sig = inspect.signature(fn)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as err:
            out.append({"error": str(err), "params": list(sig.parameters)})
            continue
        defaults = {
            p.name: repr(p.default)
            for p in sig.parameters.values()
            if p.name not in bound.arguments and p.default is not p.empty
        }
        out.append({"bound": dict(bound.arguments), "defaults": defaults, "params": list(sig.parameters)})
    return out


def _call_spec(call: ast.Call, source: str) -> list:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else ALIASES.get(func.id, func.id)

    def text(node: ast.AST) -> str | None:
        return ast.get_source_segment(source, node)

    return [name, [text(a) for a in call.args], {k.arg: text(k.value) for k in call.keywords}]


def _changed(before: dict, after: dict | None) -> bool:
    if after is None or "error" in after:
        return True
    common = set(before["defaults"]) & set(after["defaults"])
    return before["bound"] != after["bound"] or any(before["defaults"][p] != after["defaults"][p] for p in common)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
def test_report_matches_the_real_signatures(tree):
    step = tree / "pkg" / "step.py"
    marked = _markers(STEP)
    calls = {}  # line -> spec of the parallel_state call on that line
    for node in ast.walk(ast.parse(STEP)):
        if isinstance(node, ast.Call) and node.lineno in marked and node.lineno not in calls:
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "mpu"
                or isinstance(func, ast.Name)
                and (func.id in ALIASES or func.id.startswith(("get_", "is_")))
            ):
                calls[node.lineno] = _call_spec(node, STEP)
    findings = check_file(str(step), parse_release("0.13"), parse_release("0.19")).findings
    fixes = [(f, _call_spec(ast.parse(f.fixed_call).body[0].value, f.fixed_call)) for f in findings if f.fixed_call]
    assert {f.kind for f, _ in fixes} == {"positional shift", "removed keyword", "removed init argument"}
    removed = {
        "is_inside_encoder",
        "get_data_modulo_expert_parallel_group",
        "is_unitialized",
        "_PIPELINE_MODEL_PARALLEL_SPLIT_RANK",
        "_PIPELINE_GLOBAL_RANKS",
        "get_expert_data_parallel_group",
        "is_initialized",
    }
    lines = sorted(calls)
    specs = [calls[n] for n in lines] + [spec for _, spec in fixes]
    with ThreadPoolExecutor(2) as pool:  # 0.13 is not served by compat; 0.19 is, and must bind alike
        old, new = pool.map(
            lambda version: wheels.run_in_release(
                version, "tests.tools.test_port_upgrade", "real_bindings", specs, sorted(removed), version == TO
            ),
            (FROM, TO),
        )
    assert new["compat"]["served"] == TO
    assert new["compat"]["calls"] == new["calls"] and new["compat"]["names"] == new["names"]
    n = len(lines)
    assert all(r is not None and "bound" in r for r in old["calls"]), "the sample must be valid 0.13 code"
    changed = {line for line, a, b in zip(lines, old["calls"][:n], new["calls"][:n]) if _changed(a, b)}
    call_findings = {f.line for f in findings if f.kind != "removed global" and not f.use.startswith("from ")}
    assert changed == call_findings, (changed, call_findings)
    assert 9 in changed and 16 in changed and 18 in changed  # the positional headline cases
    # every fixed call means in 0.19 (and in 0.13) what the original meant in 0.13, less the
    # arguments whose parameter 0.19 lacks
    for (finding, _), fixed_old, fixed_new in zip(fixes, old["calls"][n:], new["calls"][n:]):
        i = lines.index(finding.line)
        original, params_019 = old["calls"][i]["bound"], new["calls"][i]["params"]
        expected = {p: v for p, v in original.items() if p in params_019}
        assert fixed_new.get("bound") == expected and fixed_old.get("bound") == expected, finding.format()
        if finding.kind == "positional shift":  # the original call binds differently in 0.19 (or not at all)
            assert new["calls"][i].get("bound") != original, finding.format()
    # removed functions and globals are gone from 0.19's module, present in 0.13's; replacements exist in 0.19
    for name in removed - {"_PIPELINE_GLOBAL_RANKS", "get_expert_data_parallel_group", "is_initialized"}:
        assert old["names"][name] and not new["names"][name], name
    assert all(new["names"][n] for n in ("_PIPELINE_GLOBAL_RANKS", "get_expert_data_parallel_group", "is_initialized"))


GRIDS = """\
from megatron.core.hyper_comm_grid import HyperCommGrid  # gone: 0.13


def build(world):
    grid = HyperCommGrid([2, world // 2], ["tp", "dp"])
    tp = grid.create_pg(["tp"], view="expert")  # gone: 0.15
    dp = grid.get_pg(["dp"])
    order = grid.get_rank_enum(["tp", "dp"])  # gone: 0.15
    grid.register_view("expert", [2, world // 2], ["ep", "edp"])  # gone: 0.15
    return tp, dp, order
"""


def test_hyper_comm_grid_uses(tmp_path, capsys):
    """Methods / keywords a downgrade loses (from releases.hyper_comm_grid.differences), the module before 0.14."""
    path = tmp_path / "grids.py"
    path.write_text(GRIDS)
    marked = {n: line.rsplit("gone: ", 1)[1] for n, line in enumerate(GRIDS.splitlines(), 1) if "# gone: " in line}
    for spec, target in (("0.19:0.15", "0.15"), ("0.19:0.13", "0.13")):
        status, lines, summary = _report(path, spec, capsys)
        expected = sorted(n for n, release in marked.items() if release == target)
        assert status == 1 and [int(line.split(":")[1]) for line in lines] == expected, lines
        assert f"{len(expected)} break (HyperCommGrid: {len(expected)})" in summary
    assert "keyword view does not exist in 0.15 (it would go to **kwargs) -> drop view=" in "\n".join(
        _report(path, "0.19:0.15", capsys)[1]
    )
    status, lines, summary = _report(path, "0.15:0.19", capsys)
    assert (status, lines) == (0, []) and summary.endswith("nothing breaks")


def test_upgrade_points_at_layout_diff(tree, capsys):
    main(["port", str(tree), "--upgrade", "0.15:0.16"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    command = last.split(": ", 1)[1]
    assert command.startswith("python -m parallel_state_ng layout ")
    argv = command.split()[3:]  # the exact command runs, and shows the release pair's layout changes
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert out.startswith("layout diff 0.15 -> 0.16: they differ")
    assert "timeout torch's default timeout -> the init timeout (ReleaseFacts.expert_group_timeout)" in out
