"""Bad arguments to every public sleep entry point raise at once, naming the parameter and the value.

Entry points: ``parallel_state_ng.groups.sleep`` (``sleep``, ``wake``, ``asleep``),
``compat.parallel_state`` (``sleep_model_parallel``, ``wake_model_parallel``,
``model_parallel_asleep``) and ``MegatronGroups.sleep`` / ``wake``. The checks run before the
agreement round: no world is needed for them, and no other rank is waited for.
"""

from __future__ import annotations

import re

import pytest

import compat.parallel_state as ps
from parallel_state_ng import build_megatron_groups
from parallel_state_ng.groups import sleep as sleeping

BAD_TIMEOUTS = [0, -1, -0.5, float("nan"), float("inf"), "5", None, True, [1]]


def _entry_points():
    """(name, call(**kwargs)) for every public entry point that takes ``timeout`` and ``kinds``."""

    def entered(cm):
        def call(**kwargs):
            with cm(**kwargs):
                pass

        return call

    return [
        ("sleep", sleeping.sleep),
        ("wake", sleeping.wake),
        ("asleep", entered(sleeping.asleep)),
        ("sleep_model_parallel", ps.sleep_model_parallel),
        ("wake_model_parallel", ps.wake_model_parallel),
        ("model_parallel_asleep", entered(ps.model_parallel_asleep)),
    ]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_a_bad_timeout_is_refused_naming_it(timeout):
    for name, call in _entry_points():
        with pytest.raises(ValueError, match=r"^timeout must be a finite number of seconds > 0, got ") as info:
            call(timeout=timeout)
        assert repr(timeout) in str(info.value) or str(timeout) in str(info.value), name


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        ("DATA_PARALLEL", "kinds must be an iterable (not a str) or None, got kinds='DATA_PARALLEL' (str)"),
        (5, "kinds must be an iterable (not a str) or None, got kinds=5 (int)"),
        ([3], "kinds must hold kind names (non-empty str, e.g. 'DATA_PARALLEL'), got [3]"),
        ([""], "kinds must hold kind names (non-empty str, e.g. 'DATA_PARALLEL'), got ['']"),
    ],
    ids=["a str", "an int", "an int name", "an empty name"],
)
def test_bad_kinds_are_refused_naming_them(kinds, message):
    for name, call in _entry_points():
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            call(kinds=kinds, timeout=1)
        assert not sleeping._asleep, name


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ("TP", "groups must be an iterable (not a str) or None, got groups='TP' (str)"),
        (7, "groups must be an iterable (not a str) or None, got groups=7 (int)"),
        ([[0, 1]], "groups must hold torch ProcessGroups (or None), got [0, 1] (list)"),
    ],
    ids=["a str", "an int", "ranks"],
)
def test_bad_groups_are_refused_naming_them(groups, message):
    for call in (sleeping.sleep, sleeping.wake):
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            call(groups, timeout=1)
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"), sleeping.asleep(groups, timeout=1):
        pass


def test_megatron_groups_refuse_a_bad_timeout(fake_world):
    fake_world(0, 4)
    groups = build_megatron_groups(tensor_model_parallel_size=2)
    try:
        for call in (groups.sleep, groups.wake):
            with pytest.raises(ValueError, match=r"^timeout must be a finite number of seconds > 0, got -3$"):
                call(timeout=-3)
            with pytest.raises(ValueError, match=r"^timeout must be a finite number of seconds > 0, got 'x'$"):
                call(timeout="x")
    finally:
        groups.destroy()
