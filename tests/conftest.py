"""Shared pytest fixtures and markers; simulated ranks and gloo worlds come from the public plugin.

Imports are package-style (``tests.support.X``): the repository root is on ``sys.path`` through
``pythonpath`` in pyproject.toml, so nothing here edits ``sys.path``.

Markers (registered in pyproject.toml, ``--strict-markers``): ``slow``, ``multiprocess`` and
``network`` are set in the test modules (``pytestmark`` or a decorator); a test that uses a
gloo-world fixture is marked ``multiprocess`` here as well.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys

# One intra-op thread per process, set before torch is first imported here: the suite runs two
# pytest workers, each starting worlds of up to 8 processes, on machines of 2 cores; torch's
# default (a thread per core in every process) only oversubscribes them. Children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The public fixtures (parallel_state_ng/testing/pytest_plugin.py), aliased below; pytester for
# the plugin's own test.
pytest_plugins = ["parallel_state_ng.testing.pytest_plugin", "pytester"]

# Fixtures whose users run code in worker processes.
_PROCESS_FIXTURES = frozenset({"gloo_world", "psng_gloo_world", "fresh_world_2"})


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--megatron-core VERSION``: run the suite as if that megatron-core release were installed."""
    parser.addoption(
        "--megatron-core",
        metavar="VERSION",
        default=None,
        help=(
            "serve this megatron-core release (e.g. 0.19.2) instead of the installed one: its unzipped "
            "wheel (tests.support.releases.wheels.release_dir, downloaded once) goes first on sys.path "
            "and PYTHONPATH, so importlib.metadata and every child process see that release"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    """Put the ``--megatron-core`` release first on the path, before any test module imports megatron.

    Runs in the controller and again in each xdist worker (the option is passed on; workers also
    inherit PYTHONPATH). Refuses when megatron is already imported: the path would not take effect.
    """
    version = config.getoption("--megatron-core")
    if not version:
        return
    from tests.support.releases import wheels

    if version not in wheels.RELEASES.values():
        raise pytest.UsageError(
            f"--megatron-core {version}: not a release the tests know; known: {', '.join(wheels.RELEASES.values())}"
        )
    if "megatron" in sys.modules:
        raise pytest.UsageError(f"--megatron-core {version}: megatron is already imported in this process")
    path = str(wheels.release_dir(version))
    if sys.path[:1] != [path]:
        sys.path.insert(0, path)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != path]
    os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])
    importlib.invalidate_caches()
    found = importlib.metadata.version("megatron-core")
    if found != version:
        raise pytest.UsageError(f"--megatron-core {version}: importlib.metadata still reports {found} from {path}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The megatron-core release the run serves (installed, or given by ``--megatron-core``), and
    the part of the rotating plans this run covers (:mod:`tests.support.rotation`).
    """
    try:
        found = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        found = "not installed"
    chosen = config.getoption("--megatron-core")
    from tests.support import rotation

    release = f"megatron-core: {found}" + (" (--megatron-core: its wheel first on sys.path)" if chosen else "")
    return [release, rotation.describe()]


def _weight(item: pytest.Item) -> int:
    """Rough cost class of a test from its markers: 3 slow and multiprocess, 1 either, 0 neither."""
    slow = item.get_closest_marker("slow") is not None
    multiprocess = item.get_closest_marker("multiprocess") is not None
    return 3 if slow and multiprocess else int(slow or multiprocess)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a gloo-world fixture ``multiprocess``, skip ``rotating`` tests whose
    part is not this run's (:mod:`tests.support.rotation`); run costly modules first.

    Modules stay whole and keep their own order; the modules with the most slow and
    multiprocess tests come first. Under ``pytest -n`` with ``--dist worksteal``
    (pyproject.toml) the long tests then start at once on every worker and the short ones fill
    in at the end, instead of one long test running alone at the end.
    """
    from tests.support import rotation

    for item in items:
        if _PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
        rotating = item.get_closest_marker("rotating")
        if rotating is not None and not rotation.runs_today(*rotating.args):
            part, parts = rotating.args
            item.add_marker(
                pytest.mark.skip(
                    reason=f"rotating: part {part + 1} of {parts}, not this run's "
                    f"({rotation.ENV_VAR}=all runs every part; tests/support/rotation.py)"
                )
            )
    cost: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::", 1)[0]
        cost[module] = cost.get(module, 0) + _weight(item)
        first.setdefault(module, index)
    items.sort(key=lambda item: (-cost[item.nodeid.split("::", 1)[0]], first[item.nodeid.split("::", 1)[0]]))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """After a run that included the docs test: how many doc code blocks it executed and skipped.

    Here, not in tests/docs, because under xdist only this conftest is loaded by the controller.
    """
    test = "tests/docs/test_docs_blocks.py::"
    passed = {r.nodeid for r in terminalreporter.stats.get("passed", ()) if r.nodeid.startswith(test)}
    if not any(getattr(r, "nodeid", "").startswith(test) for group in terminalreporter.stats.values() for r in group):
        return
    from tests.support import docs

    blocks = docs.all_blocks()
    executed = {b.where for b in blocks if f"{test}test_command_block[{b.where}]" in passed}
    if f"{test}test_python_blocks" in passed:
        executed |= {b.where for b in blocks if b.kind == "python"}
    terminalreporter.write_sep("-", "docs code blocks (tests/docs/test_docs_blocks.py)")
    terminalreporter.write_line(docs.summary(blocks, executed))


@pytest.fixture
def fake_world(psng_simulated_rank):
    """``init(rank, world_size)``: the plugin's ``psng_simulated_rank`` under this suite's name."""
    return psng_simulated_rank


@pytest.fixture(scope="session")
def gloo_world(psng_gloo_world):
    """``get(world_size)``: the plugin's ``psng_gloo_world`` under this suite's name."""
    return psng_gloo_world


@pytest.fixture
def new_group_calls(monkeypatch):
    """Member lists of every ``torch.distributed.new_group`` call made during the test."""
    calls: list[list[int]] = []
    original = dist.new_group

    def recording(*args, **kwargs):
        calls.append(list(kwargs.get("ranks", args[0] if args else [])))
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    return calls
