"""Rotating samples: the costliest plans and runs cover one part per CI run, every part in turn.

A plan split into ``parts`` (every ``parts``-th item from the ``part``-th) runs only the part of
the day in a default run: ``part = day % parts``, ``day`` being the UTC date's ordinal. Runs on
consecutive days cover the whole plan; ``PSNG_TEST_ROTATION=all`` runs every part at once (each
as its own test, so that pytest's workers share them) and ``PSNG_TEST_ROTATION=K`` runs part
``K % parts``, to repeat a failure seen on another day. The pytest header names the part.

Three forms: a plan split inside one test (:func:`parts_to_run`), a parametrization over
releases that keeps some releases in every run (:func:`sample`), and whole tests marked
``@pytest.mark.rotating(part, parts)`` (skipped, with the reason, on the other days: tests/conftest.py).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Collection, Sequence
from typing import TypeVar

T = TypeVar("T")

ENV_VAR = "PSNG_TEST_ROTATION"


def _setting() -> str:
    return os.environ.get(ENV_VAR, "").strip().lower()


def every_part() -> bool:
    """Whether this run covers every part (``PSNG_TEST_ROTATION=all``)."""
    return _setting() == "all"


def day_index() -> int:
    """The rotation index: ``PSNG_TEST_ROTATION`` when it is an integer, else today's UTC ordinal.

    Raises:
        ValueError: ``PSNG_TEST_ROTATION`` is neither empty, ``all`` nor a non-negative integer.
    """
    value = _setting()
    if value in ("", "all"):
        return datetime.datetime.now(datetime.timezone.utc).date().toordinal()
    if not value.isdigit():
        raise ValueError(f"{ENV_VAR} must be 'all' or a non-negative integer, got {value!r}")
    return int(value)


def parts_to_run(parts: int) -> list[int]:
    """The parts of a plan split in ``parts`` that this run covers: all of them, or the day's one."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return list(range(parts)) if every_part() else [day_index() % parts]


def describe() -> str:
    """One line for the pytest header: which part rotating plans run, and how to run all."""
    if every_part():
        return f"rotating plans: every part ({ENV_VAR}=all)"
    return (
        f"rotating plans: part {day_index()} modulo each plan's number of parts "
        f"({ENV_VAR}=all: every part; {ENV_VAR}=K: the parts of day K)"
    )


def runs_today(part: int, parts: int) -> bool:
    """Whether part ``part`` of ``parts`` is covered by this run."""
    return part in parts_to_run(parts)


def sample(items: Sequence[T], keep: Collection[T], parts: int) -> list[T]:
    """``items`` this run covers: those in ``keep`` always, of the others every ``parts``-th from the day's part."""
    others = [x for x in items if x not in keep]
    chosen = {x for i, x in enumerate(others) if runs_today(i % parts, parts)}
    return [x for x in items if x in keep or x in chosen]
