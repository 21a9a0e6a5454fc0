"""Shared pytest fixtures (simulated ranks on the fake backend, persistent gloo worlds) and markers.

Imports are package-style (``tests.support.X``): the repository root is on ``sys.path`` through
``pythonpath`` in pyproject.toml, so nothing here edits ``sys.path``.

Markers (registered in pyproject.toml, ``--strict-markers``): ``slow``, ``multiprocess`` and
``network`` are set in the test modules (``pytestmark`` or a decorator); a test that uses a
gloo-world fixture is marked ``multiprocess`` here as well.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

# Fixtures whose users run code in worker processes.
_PROCESS_FIXTURES = frozenset({"gloo_world", "fresh_world_2"})


def _weight(item: pytest.Item) -> int:
    """Rough cost class of a test from its markers: 3 slow and multiprocess, 1 either, 0 neither."""
    slow = item.get_closest_marker("slow") is not None
    multiprocess = item.get_closest_marker("multiprocess") is not None
    return 3 if slow and multiprocess else int(slow or multiprocess)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a gloo-world fixture ``multiprocess``; run costly modules first.

    Modules stay whole and keep their own order; the modules with the most slow and
    multiprocess tests come first. Under ``pytest -n`` with ``--dist worksteal``
    (pyproject.toml) the long tests then start at once on every worker and the short ones fill
    in at the end, instead of one long test running alone at the end.
    """
    for item in items:
        if _PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
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
def fake_world():
    """Return ``init(rank, world_size)`` that (re)initializes a fake-backend world.

    The default process group is destroyed after the test, so tests stay independent.
    """
    from tests.support.worlds.fake import fake_world

    yield fake_world
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def gloo_world():
    """Return ``get(world_size)``: a persistent :class:`tests.support.worlds.gloo.GlooWorld`, one per size.

    Worlds are shared by all tests of one pytest(-xdist) worker process and closed at the end
    of the session; a world that failed (timeout, dead worker) is replaced on the next get.
    """
    from tests.support.worlds.gloo import GlooWorld

    worlds: dict[int, GlooWorld] = {}

    def get(world_size: int) -> GlooWorld:
        world = worlds.get(world_size)
        if world is None or world.closed:
            world = worlds[world_size] = GlooWorld(world_size)
        return world

    yield get
    for world in worlds.values():
        world.close()


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
