"""Bounded reading of the files the tools and the API accept, and the size limits, stated once.

Every file read (layout snapshots, topology specs, ``--check`` / ``--diff`` inputs) goes
through :func:`read_bounded` and :func:`load_json`: a size limit (:data:`MAX_INPUT_BYTES`,
checked before the whole file is read), a nesting-depth limit (:data:`MAX_JSON_DEPTH`,
checked by a linear scan before ``json.loads``, so a deep file never reaches Python's
recursion limit), UTF-8 text and no duplicate object keys. The callers then check the schema
before any number from the file drives work or memory. Numbers that would size work are
bounded by :data:`MAX_ENUMERATED_RANKS` (a tool that lists every group of a world) and
:data:`MAX_RANK` (any rank or world size). Errors are :class:`InputLimitError` (a
``ValueError``) or the caller's own error class, with one line naming the source, the field
and the limit. Pure: no ``torch``. The limits: docs/reliability.md ("Hostile input").
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from typing import IO, Any

__all__ = [
    "MAX_INPUT_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_ENUMERATED_RANKS",
    "MAX_RANK",
    "MAX_TOPOLOGY_MODULES",
    "InputLimitError",
    "json_depth_error",
    "load_json",
    "read_bounded",
    "check_enumerable",
    "check_rank_bound",
    "shown",
]

#: Largest file (bytes) a tool or loader reads: a snapshot of :data:`MAX_ENUMERATED_RANKS`
#: ranks with every kind fits (8.9 MB at 65,536 ranks, 0.19, tp 8 pp 4 cp 2 ep 8: about 36 MB at 2**18).
MAX_INPUT_BYTES = 64 * 1024 * 1024
#: Deepest nesting of JSON arrays and objects accepted (a snapshot nests 5 deep, a spec 4).
MAX_JSON_DEPTH = 32
#: Largest world (ranks) a tool enumerates group by group, and that a snapshot may state.
#: Beyond it the layout tool answers one rank's view only (``--rank``), in closed form.
MAX_ENUMERATED_RANKS = 2**18
#: Largest world size, rank or rank-range end accepted anywhere (ranks are int64 in torch).
MAX_RANK = 2**62
#: Most modules a topology spec may hold.
MAX_TOPOLOGY_MODULES = MAX_ENUMERATED_RANKS


class InputLimitError(ValueError):
    """A file or argument beyond a documented limit or not well formed; one line, naming the field."""


def _fail(error: type[Exception], source: str, field: str, message: str) -> Exception:
    return error(f"{source}: {field}: {message}")


# A JSON string, or an unterminated one running to the end (so a scan never restarts inside it).
_STRING = re.compile(r'"(?:[^"\\]++|\\.|\\\Z)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth_error(text: str, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """``None`` when ``text`` nests arrays/objects at most ``max_depth`` deep, else the reason.

    Linear and without recursion: strings are cut out, the brackets left are summed as +1/-1
    and the largest running sum is the depth (all in C loops: regular expressions, ``map``,
    ``accumulate``).
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
    if depth > max_depth:
        return f"nests {depth} levels deep, over the limit of {max_depth}"
    return None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


class _DuplicateKey(Exception):
    pass


def _reject_constant(name: str) -> Any:
    raise _BadConstant(name)


class _BadConstant(Exception):
    pass


def load_json(
    text: str | bytes,
    source: str,
    *,
    max_bytes: int = MAX_INPUT_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    error: type[Exception] = InputLimitError,
) -> Any:
    """Parse JSON ``text`` within the limits; raises ``error`` with one line ``SOURCE: FIELD: ...``.

    Refused: more than ``max_bytes`` bytes, nesting deeper than ``max_depth``, bytes that are
    not UTF-8, text that is not JSON (truncated or not), a key twice in one object, and the
    non-standard constants ``NaN`` / ``Infinity``.
    """
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise _fail(error, source, "size", f"{size} bytes is over the limit of {max_bytes} bytes")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _fail(error, source, "encoding", f"not UTF-8 text (byte {err.start})") from None
    deep = json_depth_error(text, max_depth)
    if deep is not None:
        raise _fail(error, source, "nesting", deep)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        cut = " (truncated?)" if err.pos >= len(text.rstrip()) else ""
        raise _fail(
            error, source, "json", f"not valid JSON{cut}: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    except _DuplicateKey as dup:
        raise _fail(error, source, "json", f"key {dup.args[0]!r} appears twice in one object") from None
    except _BadConstant as bad:
        raise _fail(error, source, "json", f"{bad.args[0]} is not a JSON number") from None
    except (RecursionError, MemoryError, ValueError) as err:  # defensive: limits should prevent these
        raise _fail(error, source, "json", f"cannot be parsed: {type(err).__name__}") from None


def read_bounded(path: str, source: str, *, max_bytes: int = MAX_INPUT_BYTES, stdin: IO[str] | None = None) -> str:
    """The UTF-8 text of the file ``path`` (``"-"``: stdin), reading at most ``max_bytes + 1`` bytes.

    Raises:
        InputLimitError: the file cannot be read, is larger than ``max_bytes`` or is not UTF-8.
    """
    if path == "-":
        stream = stdin if stdin is not None else sys.stdin
        buffer = getattr(stream, "buffer", None)
        data: str | bytes = buffer.read(max_bytes + 1) if buffer is not None else stream.read(max_bytes + 1)
    else:
        try:
            with open(path, "rb") as handle:
                data = handle.read(max_bytes + 1)
        except OSError as err:
            raise InputLimitError(f"cannot read {source}: {err.strerror or err}") from None
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise InputLimitError(f"{source}: size: over the limit of {max_bytes} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputLimitError(f"{source}: encoding: not UTF-8 text (byte {err.start})") from None


def check_enumerable(world_size: int, field: str, source: str, error: type[Exception] = InputLimitError) -> None:
    """Refuse a world of more than :data:`MAX_ENUMERATED_RANKS` ranks that would be enumerated."""
    if world_size > MAX_ENUMERATED_RANKS:
        raise _fail(
            error,
            source,
            field,
            f"{world_size} ranks is over the limit of {MAX_ENUMERATED_RANKS} ranks that are enumerated group by group",
        )


def check_rank_bound(value: int, what: str, error: type[Exception] = InputLimitError) -> None:
    """Refuse a world size, rank or range end above :data:`MAX_RANK`."""
    if value > MAX_RANK:
        raise error(f"{what} {value} is over the limit of {MAX_RANK} (2**62)")


#: The most characters of a value an error message repeats (:func:`shown`).
MAX_SHOWN_CHARS = 80


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the full length named.

    An environment variable or argument may hold megabytes; its error stays one short line.
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
