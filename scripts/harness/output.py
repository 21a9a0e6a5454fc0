"""Output helpers of the scripts: markdown tables and JSON, to stdout or a file."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table (``| a | b |`` lines, a ``|---|`` separator), each cell ``str()``-ed.

    Raises:
        ValueError: a row has not as many cells as there are headers.
    """
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for number, row in enumerate(rows):
        cells = [str(cell) for cell in row]
        if len(cells) != len(headers):
            raise ValueError(f"row {number} has {len(cells)} cells, the table has {len(headers)} columns: {row!r}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def json_text(value: Any, *, indent: int | None = 2) -> str:
    """``value`` as JSON text (keys in their order, non-ASCII kept), ending in a newline."""
    return json.dumps(value, indent=indent, ensure_ascii=False) + "\n"


def write_json(value: Any, path: str | None = None, *, stream: TextIO | None = None) -> None:
    """Write ``value`` as JSON to the file ``path``, or to ``stream`` (default stdout) when ``path`` is None."""
    text = json_text(value)
    if path is None:
        (stream or sys.stdout).write(text)
        return
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
