"""The ``port`` command on a small tree written to tmp_path.

Every line of the sample sources that uses ``megatron.core.parallel_state`` carries a
``# use: <category>[,<category>...]`` marker; the report must list exactly those lines (and
categories). The rewrite is checked as a diff (dry run) and after ``--apply`` (the files parse,
import compat, and the rewritten module works against ``compat.parallel_state``).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
from collections import Counter
from pathlib import Path

import pytest

from parallel_state_ng.__main__ import main
from parallel_state_ng.layout.megatron_layout import GROUP_KINDS
from parallel_state_ng.releases import SUPPORTED_SERIES
from parallel_state_ng.releases import parallel_state as release_api
from parallel_state_ng.tools.port.port import GETTER_VARIANTS, NAMED_GRID_GETTERS, compat_api
from tests.support import served

SOURCES = {
    "pkg/__init__.py": "",
    "pkg/train.py": '''\
"""Training step using several import styles."""
import os

from megatron.core import parallel_state as mpu  # use: import
from megatron.core import parallel_state, tensor_parallel  # use: import


def step(flag):
    tp = mpu.get_tensor_model_parallel_group()  # use: call
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)  # use: call
    rank = mpu.get_data_parallel_rank(with_context_parallel=flag)  # use: call
    stages = mpu._PIPELINE_GLOBAL_RANKS  # use: read
    mpu._PIPELINE_GLOBAL_RANKS = list(stages)  # use: write
    getter = mpu.get_pipeline_model_parallel_group  # use: reference
    missing = mpu.get_not_a_real_function()  # use: call unknown
    return tp, dp_cp, rank, getter, missing, tensor_parallel, os
''',
    "pkg/models/__init__.py": "",
    "pkg/models/layer.py": """\
import megatron.core.parallel_state  # use: import
import megatron.core.parallel_state as ps  # use: import
from megatron.core import mpu  # use: import
from megatron.core.parallel_state import (  # use: import
    get_tensor_model_parallel_rank,
    get_pipeline_model_parallel_world_size as pp_size,
    _TENSOR_MODEL_PARALLEL_GROUP,
)


def describe():
    return {
        "initialized": megatron.core.parallel_state.model_parallel_is_initialized(),  # use: call
        "module": ps,
        "mpu": mpu,
        "tp_group_global": _TENSOR_MODEL_PARALLEL_GROUP,  # use: read
    }


def sizes():
    return get_tensor_model_parallel_rank(), pp_size()  # use: call,call


def drop():
    del mpu._EMBEDDING_GROUP  # use: delete
""",
    "pkg/models/clean.py": """\
import megatron.core.tensor_parallel


class Holder:
    mpu = None


def f(mpu):
    return mpu.get_tensor_model_parallel_group(), Holder.mpu, megatron.core.tensor_parallel
""",
    "pkg/broken.py": "def oops(:\n    pass\n",
    # relative imports inside a vendored copy of Megatron's package
    "vendored/megatron/__init__.py": "",
    "vendored/megatron/core/__init__.py": "",
    "vendored/megatron/core/models/__init__.py": "",
    "vendored/megatron/core/models/gpt.py": """\
from .. import parallel_state, tensor_parallel  # use: import
from ..parallel_state import get_context_parallel_group, get_gone  # use: import,name


def build():
    return parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True), tensor_parallel  # use: call
""",
}
LINE = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): (?P<what>.*?) -> (?P<eq>.*)$")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel, text in SOURCES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def expected_uses(root: Path) -> Counter:
    out: Counter = Counter()
    for rel, text in SOURCES.items():
        for number, line in enumerate(text.splitlines(), 1):
            if "# use:" in line:
                for category in line.split("# use:")[1].split()[0].split(","):
                    out[(str(root / rel), number, category)] += 1
    return out


def category_of(what: str) -> str:
    if what.startswith("import of "):
        return "name"
    if what.startswith(("import ", "from ")):
        return "import"
    return what.split()[0]


def report_lines(out: str) -> list[re.Match]:
    return [m for m in map(LINE.match, out.splitlines()) if m]


def test_report_lists_exactly_the_marked_lines(tree, capsys):
    assert main(["port", str(tree)]) == 0
    out, err = capsys.readouterr()
    found = Counter((m["path"], int(m["line"]), category_of(m["what"])) for m in report_lines(out))
    assert found == expected_uses(tree)
    assert f"{tree / 'pkg/broken.py'}:1: cannot parse" in err

    by_line = {(Path(m["path"]).name, int(m["line"]), m["what"]): m["eq"] for m in report_lines(out)}
    eq = {(name, line): text for (name, line, _), text in by_line.items()}
    assert eq[("train.py", 4)] == "from compat import parallel_state as mpu"
    assert eq[("train.py", 5)] == "from compat import parallel_state; from megatron.core import tensor_parallel"
    assert 'compat.parallel_state.get_state().groups["tp"] (tp group of MegatronLayout' in eq[("train.py", 9)]
    assert eq[("train.py", 9)].startswith("compat.parallel_state.get_tensor_model_parallel_group() | named grid:")
    assert 'get_state().groups["dp_cp"]' in eq[("train.py", 10)]
    assert (
        'groups["dp"].rank()' in eq[("train.py", 11)]
        and "'dp_cp' with with_context_parallel=True" in eq[("train.py", 11)]
    )
    assert 'get_state().ranks["pp"]' in eq[("train.py", 12)]
    assert eq[("train.py", 13)].startswith("compat.parallel_state._PIPELINE_GLOBAL_RANKS (compat's getters read")
    assert 'groups["pp"]' in eq[("train.py", 14)]
    assert eq[("train.py", 15)] == "UNKNOWN: compat.parallel_state has no 'get_not_a_real_function'"
    assert eq[("layer.py", 1)] == "import compat.parallel_state"
    assert eq[("layer.py", 3)] == "from compat import parallel_state as mpu"
    assert "(imported by name: a copy taken at import time)" in eq[("layer.py", 16)]
    assert eq[("gpt.py", 1)] == "from compat import parallel_state; from .. import tensor_parallel"
    if "partial_expert_data_parallel" in _served_parameters("get_expert_data_parallel_group"):
        assert 'groups["intra_ep_dp"]' in eq[("gpt.py", 6)]
    else:  # 0.12's getter takes no such keyword: the call does not bind, the alternatives are listed
        assert "'intra_ep_dp' with partial_expert_data_parallel=True" in eq[("gpt.py", 6)]
    assert "UNKNOWN" in by_line[("gpt.py", 2, "import of get_gone")]

    summary = out.splitlines()[-1]
    uses = sum(expected_uses(tree).values())
    assert summary.startswith(
        f"scanned {len(SOURCES)} files: {uses} uses of megatron.core.parallel_state in 3 files, 8 imports to switch, "
        "2 unknown names (get_gone, get_not_a_real_function); 1 file could not be read or parsed"
    )


def test_single_file_and_missing_path(tree, capsys):
    assert main(["port", str(tree / "pkg/models/clean.py")]) == 0
    out, _ = capsys.readouterr()
    assert report_lines(out) == []
    assert out.startswith("scanned 1 file: 0 uses")
    assert main(["port", str(tree / "nope")]) == 2
    _, err = capsys.readouterr()
    assert "PATH" in err and "Traceback" not in err


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p): p.read_text() for p in sorted(root.rglob("*.py"))}


def test_rewrite_is_a_dry_run_diff_matching_apply(tree, capsys):
    before = _snapshot(tree)
    assert main(["port", str(tree), "--rewrite"]) == 0
    diff, err = capsys.readouterr()
    assert _snapshot(tree) == before
    assert f"scanned {len(SOURCES)} files" in err  # the summary goes to stderr, stdout is a clean diff
    files = re.findall(r"^\+\+\+ (.+)$", diff, flags=re.M)
    changed = [str(tree / r) for r in ("pkg/train.py", "pkg/models/layer.py", "vendored/megatron/core/models/gpt.py")]
    assert sorted(files) == sorted(changed)
    assert "\n-from megatron.core import mpu  # use: import\n" in diff
    assert "\n+from compat import parallel_state as mpu  # use: import\n" in diff
    minus = Counter(line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---"))
    plus = Counter(line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++"))

    assert main(["port", str(tree), "--apply"]) == 0
    out, _ = capsys.readouterr()
    assert sorted(re.findall(r"^rewrote (.+)$", out, flags=re.M)) == sorted(changed)
    after = _snapshot(tree)
    removed, added = Counter(), Counter()
    for path in changed:
        old, new = Counter(before[path].splitlines()), Counter(after[path].splitlines())
        removed += old - new
        added += new - old
    assert (removed, added) == (minus, plus)
    assert {p: t for p, t in after.items() if p not in changed} == {p: t for p, t in before.items() if p not in changed}


def _imports(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += ["." * node.level + (node.module or "") + ":" + a.name for a in node.names]
    return out


def test_apply_result_parses_and_uses_compat(tree, capsys):
    import compat.parallel_state as compat_ps

    assert main(["port", str(tree), "--apply"]) == 0
    capsys.readouterr()
    layer = (tree / "pkg/models/layer.py").read_text()
    assert _imports(layer) == [
        "compat.parallel_state",
        "compat.parallel_state",
        "compat:parallel_state",
        "compat.parallel_state:get_tensor_model_parallel_rank",
        "compat.parallel_state:get_pipeline_model_parallel_world_size",
        "compat.parallel_state:_TENSOR_MODEL_PARALLEL_GROUP",
    ]
    assert "compat.parallel_state.model_parallel_is_initialized()" in layer
    train_imports = _imports((tree / "pkg/train.py").read_text())
    assert "megatron.core:tensor_parallel" in train_imports and "compat:parallel_state" in train_imports
    assert not any("parallel_state" in i and not i.startswith("compat") for i in train_imports)
    gpt_imports = _imports((tree / "vendored/megatron/core/models/gpt.py").read_text())
    assert gpt_imports == [
        "compat:parallel_state",
        "..:tensor_parallel",
        "compat.parallel_state:get_context_parallel_group",
        "compat.parallel_state:get_gone",
    ]

    spec = importlib.util.spec_from_file_location("ported_layer_sample", tree / "pkg/models/layer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ps is compat_ps and module.mpu is compat_ps and module.compat.parallel_state is compat_ps
    described = module.describe()
    assert described["initialized"] is compat_ps.model_parallel_is_initialized()
    assert described["module"] is compat_ps

    # a second scan finds nothing left to switch
    assert main(["port", str(tree)]) == 0
    out, _ = capsys.readouterr()
    assert ", 0 imports to switch" in out.splitlines()[-1]


def _served_parameters(name: str) -> set[str]:
    """The parameter names of getter ``name`` in the served release."""
    return {param[0] for param in release_api.signature(name, served.served()) or ()}


def test_named_grid_table_names_exist_in_compat():
    import compat.parallel_state as compat_ps

    api = compat_api()
    release = served.served()
    for name, (kind, accessor) in NAMED_GRID_GETTERS.items():
        # the table covers every supported release (code being ported may come from any);
        # compat serves the getters of the served one (0.19 removed get_data_modulo_...)
        assert any(release_api.has(name, series) for series in SUPPORTED_SERIES), name
        assert (name in api and callable(getattr(compat_ps, name))) == release_api.has(name, release), name
        assert kind.removesuffix("_gloo") in GROUP_KINDS, (name, kind)
        assert accessor in ("group", "rank", "size", "ranks", "first", "last")
    for name, variants in GETTER_VARIANTS.items():
        assert name in NAMED_GRID_GETTERS, name
        if not release_api.has(name, release):
            continue
        params = inspect.signature(getattr(compat_ps, name)).parameters
        assert set(params) == _served_parameters(name), name
        for keywords, kind in variants:
            # keywords the served release lacks belong to another one (0.12: no partial EDP)
            takes = [
                s for s in SUPPORTED_SERIES if set(keywords) <= {p[0] for p in release_api.signature(name, s) or ()}
            ]
            assert takes, (name, keywords)
            assert kind.removesuffix("_gloo") in GROUP_KINDS, (name, kind)
    assert {"get_tensor_model_parallel_group", "_PIPELINE_GLOBAL_RANKS", "initialize_model_parallel"} <= api
    assert not {"Optional", "annotations", "torch", "timedelta", "contextmanager", "warnings"} & api


@pytest.mark.filterwarnings("ignore:get_data_modulo_expert_parallel_group is deprecated:DeprecationWarning")
@pytest.mark.parametrize("rank", [5, 29])
def test_named_grid_table_matches_compat_getters(fake_world, rank):
    """Each getter (and keyword variant) returns the named-grid value the table names."""
    import compat.parallel_state as compat_ps

    fake_world(rank, 32)
    compat_ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=2,
        expert_model_parallel_size=2,
        num_distributed_optimizer_instances=2,
        create_gloo_process_groups=False,
    )
    checked = 0
    try:
        state = compat_ps.get_state()
        for name, (kind, accessor) in NAMED_GRID_GETTERS.items():
            if not release_api.has(name, served.served()):
                continue  # a getter of other releases (the table covers them all)
            variants = [(kws, k) for kws, k in GETTER_VARIANTS.get(name, ()) if set(kws) <= _served_parameters(name)]
            calls = [({}, kind)] + [({k: True for k in kws}, k) for kws, k in variants]
            for kwargs, k in calls:
                if k not in state.groups:  # gloo twins off; a kind this rank is in no group of
                    continue
                got = getattr(compat_ps, name)(**kwargs)
                group, ranks = state.groups[k], state.ranks.get(k)
                expected = {
                    "group": group,
                    "rank": group.rank(),
                    "size": group.size(),
                    "ranks": ranks,
                    "first": ranks and ranks[0],
                    "last": ranks and ranks[-1],
                }[accessor]
                if accessor == "group":
                    assert got is expected, (name, kwargs)
                else:
                    assert got == expected, (name, kwargs)
                checked += 1
    finally:
        compat_ps.destroy_model_parallel()
    assert checked >= 48  # the getters and variants of the release (fewest in 0.12)
