"""The served megatron-core release as tests see it: its init arguments, getters, collection.

Tests run with whichever supported megatron-core is installed (``PYTHONPATH=<release dir>:.``
makes an unzipped wheel the installed one). What a test expects of that release comes from the
release data (:mod:`parallel_state_ng.releases`: :func:`~parallel_state_ng.releases.current_release`,
its :func:`~parallel_state_ng.releases.facts.release_facts` and its API surface), never from
one release written into the test; a test that cannot apply to the release skips, naming the
release and the reason (:func:`skip_unless`).
"""

from __future__ import annotations

from typing import Any

import pytest

from parallel_state_ng.releases import Release, current_release
from parallel_state_ng.releases import parallel_state as api
from parallel_state_ng.releases.facts import ReleaseFacts, release_facts
from parallel_state_ng.releases.process_groups_config import COLLECTION_CLASS

__all__ = [
    "served",
    "served_facts",
    "init_parameters",
    "has_collection",
    "skip_unless",
    "init_call",
    "initialize",
]

ALL_GATHER = "create_all_gather_group"


def served() -> Release:
    """The release compat serves in this process (:func:`~parallel_state_ng.releases.current_release`)."""
    return current_release()


def served_facts() -> ReleaseFacts:
    """The :class:`ReleaseFacts` of :func:`served`."""
    return release_facts(served())


def init_parameters() -> frozenset[str]:
    """The parameter names of the served release's ``initialize_model_parallel``."""
    return frozenset(name for name, _ in api.signature("initialize_model_parallel", served()) or ())


def has_collection() -> bool:
    """Whether the served release has Megatron's ``ProcessGroupCollection`` (0.15 on)."""
    return COLLECTION_CLASS[served().series] is not None


def skip_unless(condition: bool, why: str) -> None:
    """Skip the test unless ``condition``: ``megatron-core <served release> <why>``."""
    if not condition:
        pytest.skip(f"megatron-core {served()} {why}")


def init_call(kwargs: dict[str, Any], *, optional: tuple[str, ...] = ()) -> tuple[dict[str, Any], bool]:
    """``kwargs`` as the served release's ``initialize_model_parallel`` takes them.

    Returns the keyword arguments and whether to call ``create_all_gather_groups()`` after the
    init: ``create_all_gather_group=True`` (0.16-0.17) becomes that call on the releases that
    build the all-gather groups after init (0.18+). Keys named in ``optional`` that the release
    lacks are left out; any other key it lacks skips the test, naming the release and the keys.
    """
    accepted = init_parameters()
    out = dict(kwargs)
    after = False
    if ALL_GATHER in out and ALL_GATHER not in accepted and served_facts().all_gather_groups_function:
        after = bool(out.pop(ALL_GATHER))
    missing = sorted(set(out) - accepted)
    required = [name for name in missing if name not in optional]
    skip_unless(not required, f"has no initialize_model_parallel argument {', '.join(required)}")
    for name in missing:
        del out[name]
    return out, after


def initialize(ps: Any, kwargs: dict[str, Any], *, optional: tuple[str, ...] = ()) -> None:
    """``ps.initialize_model_parallel`` with :func:`init_call`'s arguments, then the all-gather groups."""
    init_kwargs, all_gather_after = init_call(kwargs, optional=optional)
    ps.initialize_model_parallel(**init_kwargs)
    if all_gather_after:
        ps.create_all_gather_groups()
