"""``compat.parallel_state`` has exactly the public API of the installed Megatron-Core.

The API is derived from ``megatron.core.parallel_state`` itself (every public function,
``RankGenerator`` and its methods, every ``_``-prefixed module global that is state), so a
name added to a newer Megatron-Core is not silently skipped. Signatures must agree in
parameter names, kinds and defaults (annotations are not compared: compat may write them as
strings). Importing ``compat`` must not import megatron.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import megatron.core.parallel_state as mcore_ps
import pytest

import compat.parallel_state as compat_ps
from tests.support.differential import library as D
from tests.support.paths import ROOT

FUNCTIONS = sorted(D.reference_functions())
GLOBALS = D.reference_globals()
RANK_GENERATOR_METHODS = sorted(
    name
    for name, obj in vars(mcore_ps.RankGenerator).items()
    if inspect.isfunction(obj) and (not name.startswith("_") or name == "__init__")
)


def _shape(fn) -> list[tuple[str, str, object]]:
    """(name, kind, default) of every parameter; ``inspect.Parameter.empty`` shown as '<none>'."""
    return [
        (p.name, p.kind.name, "<none>" if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(fn).parameters.values()
    ]


def test_reference_api_is_not_empty():
    """The derivation found the API (guards against a silently empty parametrization)."""
    assert len(FUNCTIONS) >= 60 and "initialize_model_parallel" in FUNCTIONS  # 0.12 has the fewest
    assert len(GLOBALS) >= 40 and "_TENSOR_MODEL_PARALLEL_GROUP" in GLOBALS
    assert {"__init__", "get_mask", "get_ranks"} <= set(RANK_GENERATOR_METHODS)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_exists_with_the_same_signature(name):
    """Compat defines ``name`` as a function with MCore's parameter names, kinds and defaults."""
    ours = getattr(compat_ps, name, None)
    assert ours is not None, f"compat.parallel_state lacks {name}"
    assert callable(ours) and not inspect.isclass(ours), f"compat.parallel_state.{name} is not a function"
    assert _shape(ours) == _shape(getattr(mcore_ps, name)), (
        f"{name}: compat {inspect.signature(ours)} != MCore {inspect.signature(getattr(mcore_ps, name))}"
    )


def test_rank_generator_is_a_class():
    """``RankGenerator`` is a class (code subclasses and isinstance-checks it)."""
    assert inspect.isclass(getattr(compat_ps, "RankGenerator", None))


@pytest.mark.parametrize("method", RANK_GENERATOR_METHODS)
def test_rank_generator_method_signature(method):
    """``RankGenerator.<method>`` has MCore's parameter names, kinds and defaults."""
    ours = getattr(compat_ps.RankGenerator, method, None)
    assert ours is not None, f"compat RankGenerator lacks {method}"
    theirs = getattr(mcore_ps.RankGenerator, method)
    assert _shape(ours) == _shape(theirs), f"{method}: {inspect.signature(ours)} != {inspect.signature(theirs)}"


@pytest.mark.parametrize("name", GLOBALS)
def test_module_global_exists(name):
    """Every module-level state global of MCore is readable on compat."""
    assert hasattr(compat_ps, name), f"compat.parallel_state lacks the module global {name}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_importing_compat_does_not_import_megatron():
    """``import compat, compat.parallel_state`` leaves megatron out of ``sys.modules``."""
    root = ROOT
    code = (
        "import sys, compat, compat.parallel_state\n"
        "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))\n"
    )
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", f"megatron modules imported: {done.stdout}"
