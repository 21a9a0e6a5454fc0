"""Text pieces shared by the command-line reports (``layout`` and ``topology``).

Pure formatting: rank lists for people, plurals, ``name=size`` dims, a group kind's MCore
description, and writing a report to ``--output`` or standard output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from parallel_state_ng.layout.megatron_layout import GROUP_KINDS
from parallel_state_ng.tools import UsageError

__all__ = ["format_ranks", "plural", "dims_text", "kind_text", "write_output"]

# A rank list longer than this is abbreviated to its first and last few ranks.
_RANKS_SHOWN_MAX, _RANKS_SHOWN_HEAD, _RANKS_SHOWN_TAIL = 16, 8, 2


def format_ranks(ranks: Sequence[int], full: bool = False) -> str:
    """A rank list for people: short lists in full, long ones abbreviated (with the count)."""
    n = len(ranks)
    if full or n <= _RANKS_SHOWN_MAX:
        return "[" + ", ".join(map(str, ranks)) + "]"
    step = ranks[1] - ranks[0]
    if step > 0 and all(ranks[i + 1] - ranks[i] == step for i in range(n - 1)):
        return f"[{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[-1]}] ({n} ranks, step {step})"
    head = ", ".join(map(str, ranks[:_RANKS_SHOWN_HEAD]))
    tail = ", ".join(map(str, ranks[-_RANKS_SHOWN_TAIL:]))
    return f"[{head}, ..., {tail}] ({n} ranks)"


def plural(count: int, noun: str) -> str:
    """``"1 rank"``, ``"2 ranks"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def dims_text(dims: Mapping[str, int]) -> str:
    """``{"tp": 2, "pp": 4}`` -> ``"tp=2 pp=4"`` (in the mapping's order)."""
    return " ".join(f"{name}={size}" for name, size in dims.items())


def kind_text(kind: str) -> tuple[str, str]:
    """(MCore ``group_desc``, description) of a group kind; ``hcpN`` is a hierarchical CP level."""
    if kind in GROUP_KINDS:
        return GROUP_KINDS[kind].desc, GROUP_KINDS[kind].what
    if kind.startswith("hcp"):
        return f"HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{kind[3:]}", f"hierarchical context parallel, level {kind[3:]}"
    return kind.upper(), kind


def write_output(text: str, output: str | None, stdout: Any) -> None:
    """Write ``text`` to the file ``output``, or to ``stdout`` when it is ``None``.

    Raises:
        UsageError: the file cannot be written (names ``--output``).
    """
    if output is None:
        stdout.write(text)
        return
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:
        raise UsageError(f"cannot write {output!r}: {err.strerror}", "--output") from None
