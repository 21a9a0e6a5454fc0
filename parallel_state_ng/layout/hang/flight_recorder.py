"""torch's flight-recorder dumps, read into :class:`RankRecord` and written from one.

The format (torch 2.13, ``version`` ``"2.10"``; what ``_dump_fr_trace`` pickles and
``_dump_fr_trace_json`` writes as JSON, and what the NCCL watchdog writes to
``TORCH_FR_DUMP_TEMP_FILE`` + rank): a dict with ``entries`` (one per operation, oldest first:
``process_group`` = (group name, ``group_desc``), ``profiling_name`` = ``"nccl:all_reduce"``,
``"nccl:send 0->1"``, ``"nccl:recv 1<-0"`` with group-local ranks, ``collective_seq_id``,
``p2p_seq_id``, ``is_p2p``, ``state`` (``scheduled`` / ``started`` / ``completed``),
``retired``, ``input_sizes``, ``time_created_ns``), ``pg_config`` (group name -> ``name``,
``desc``, ``ranks`` as the text of a list; NCCL fills it, gloo leaves it empty) and
``pg_status``. A file's rank is the number its name ends with, as torch's own analyzer reads it.

What torch 2.13 records on gloo (checked by ``tests/layout/test_hang_flight_recorder.py``):
collectives yes, with ``state`` always ``scheduled`` and ``retired`` true once done; p2p
(``send``/``recv``/``isend``/``irecv``) not at all, and no ``pg_config``. A gloo dump alone
therefore cannot see a rank blocked in a pipeline receive: the live watcher's own records
(:mod:`parallel_state_ng.groups.hang_watch`), written here in the same format
(:func:`records_dump`) with members and p2p entries, fill that gap. Pickles are read without
loading any class (plain containers only). Pure: no ``torch.distributed``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

from parallel_state_ng.layout.bounded_input import MAX_INPUT_BYTES, InputLimitError, load_json
from parallel_state_ng.layout.hang.place import Placer
from parallel_state_ng.layout.hang.records import OpRecord, RankRecord

__all__ = ["DumpError", "FR_VERSION", "record_of_dump", "records_dump", "load_dump", "read_dump_dir"]

#: The dump version torch 2.13 writes (and :func:`records_dump` writes).
FR_VERSION = "2.10"
_RANK_SUFFIX = re.compile(r"(\d+)(?:\.json|\.pkl)?$")
_P2P_META = re.compile(r"^(\d+)(->|<-)(\d+)$")
#: Most dump files one directory may hold (a rank each).
MAX_DUMP_FILES = 65536


class DumpError(ValueError):
    """A dump that cannot be read: the message names the file and the field."""


class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings and numbers only: a dump needs no class."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight-recorder dump holds no class, found {module}.{name}")


def load_dump(data: bytes, source: str) -> dict[str, Any]:
    """A dump's dict from its bytes: a pickle (torch's default) or JSON (``_dump_fr_trace_json``)."""
    if len(data) > MAX_INPUT_BYTES:
        raise DumpError(f"{source}: size: {len(data)} bytes is over the limit of {MAX_INPUT_BYTES} bytes")
    if data[:1] in (b"{", b" ", b"\n"):
        try:
            dump = load_json(data, source)
        except InputLimitError as err:
            raise DumpError(str(err)) from None
    else:
        try:
            dump = _PlainUnpickler(io.BytesIO(data)).load()
        except Exception as err:  # any malformed pickle: one clear error
            raise DumpError(f"{source}: not a flight-recorder dump ({type(err).__name__}: {err})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        raise DumpError(f"{source}: entries: a dump is a dict with a list of entries, got {type(dump).__name__}")
    return dump


def _members(dump: Mapping[str, Any], group: str, source: str) -> tuple[int, ...] | None:
    config = dump.get("pg_config") or {}
    entry = config.get(group) if isinstance(config, Mapping) else None
    if not isinstance(entry, Mapping):
        return None
    text = entry.get("ranks")
    try:
        ranks = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        raise DumpError(f"{source}: pg_config[{group!r}].ranks: not a list of ranks: {text!r}") from None
    if not isinstance(ranks, list) or not all(isinstance(r, int) and r >= 0 for r in ranks):
        raise DumpError(f"{source}: pg_config[{group!r}].ranks: not a list of ranks: {text!r}")
    return tuple(ranks) or None


def _op_of(entry: Any, dump: Mapping[str, Any], rank: int, placer: Placer | None, source: str) -> OpRecord | None:
    if not isinstance(entry, Mapping):
        raise DumpError(f"{source}: entries: an entry is a dict, got {type(entry).__name__}")
    try:
        group, desc = entry["process_group"]
        _, _, name = str(entry["profiling_name"]).partition(":")
        op, _, meta = name.partition(" ")
        p2p = bool(entry.get("is_p2p")) or op in ("send", "recv")
        seq = int(entry["p2p_seq_id"] if p2p else entry["collective_seq_id"])
        done = entry.get("retired") or entry.get("state") == "completed"
        state = "completed" if done else str(entry.get("state", "scheduled"))
        sizes = entry.get("input_sizes")
    except (KeyError, TypeError, ValueError) as err:
        raise DumpError(f"{source}: entries: an entry lacks or garbles {err}: {str(entry)[:200]}") from None
    if op == "coalesced":  # the wrapper of a batch: its members are recorded one by one
        return None
    group, desc = str(group), str(desc)
    ranks = _members(dump, group, source)
    if ranks is None and placer is not None and desc:
        ranks = placer.place(group, desc, rank).ranks
    peer = None
    found = _P2P_META.match(meta)
    if p2p and found and ranks is not None:
        local = int(found.group(3))
        peer = ranks[local] if local < len(ranks) else None
    created = entry.get("time_created_ns")
    try:
        return OpRecord(
            group=group,
            desc=desc,
            op=op,
            seq=seq,
            state=state if state in ("scheduled", "started", "completed") else "scheduled",
            p2p=p2p,
            peer=peer,
            ranks=ranks,
            sizes=tuple(tuple(int(x) for x in s) for s in sizes) if isinstance(sizes, list) else None,
            time_ns=created if isinstance(created, int) and not isinstance(created, bool) else None,
        )
    except (TypeError, ValueError) as err:
        raise DumpError(f"{source}: entries: an entry that is no operation ({err}): {str(entry)[:200]}") from None


def record_of_dump(
    dump: Mapping[str, Any], rank: int, placer: Placer | None = None, source: str = "dump"
) -> RankRecord:
    """One rank's record from its dump; ``placer`` supplies members where the dump has none (gloo)."""
    ops = [_op_of(e, dump, rank, placer, source) for e in dump.get("entries", [])]
    try:
        return RankRecord(rank, tuple(op for op in ops if op is not None), note=str(dump.get("psng_note", "")))
    except ValueError as err:
        raise DumpError(f"{source}: rank: {err}") from None


def records_dump(record: RankRecord, backend: str = "gloo") -> dict[str, Any]:
    """``record`` in the flight recorder's format (torch's analyzer reads it; so does :func:`record_of_dump`).

    ``psng_note`` (the rank's note) is the one field torch does not write.
    """
    entries = []
    config: dict[str, dict[str, str]] = {}
    for i, op in enumerate(record.ops):
        name = f"{backend}:{op.op}"
        if op.p2p and op.peer is not None and op.ranks is not None and op.peer in op.ranks and record.rank in op.ranks:
            me, other = op.ranks.index(record.rank), op.ranks.index(op.peer)
            name += f" {me}->{other}" if op.op == "send" else f" {me}<-{other}"
        entries.append(
            {
                "record_id": i,
                "pg_id": int(op.group) if op.group.isdigit() else 0,
                "process_group": (op.group, op.desc),
                "profiling_name": name,
                "collective_seq_id": 0 if op.p2p else op.seq,
                "p2p_seq_id": op.seq if op.p2p else 0,
                "op_id": i + 1,
                "state": op.state,
                "retired": op.done,
                "is_p2p": op.p2p,
                "input_sizes": [list(s) for s in op.sizes] if op.sizes else [],
                "output_sizes": [],
                "input_dtypes": [],
                "output_dtypes": [],
                "time_created_ns": op.time_ns or 0,
                "time_discovered_started_ns": None,
                "time_discovered_completed_ns": None,
                "timeout_ms": 0,
                "frames": [],
            }
        )
        if op.ranks is not None:
            config[op.group] = {"name": op.group, "desc": op.desc, "ranks": json.dumps(list(op.ranks))}
    return {
        "version": FR_VERSION,
        "pg_config": config,
        "pg_status": {},
        "comm_lib_version": "",
        "entries": entries,
        "psng_note": record.note,
    }


def read_dump_dir(directory: str, placer: Placer | None = None) -> list[RankRecord]:
    """Every rank's record from a directory of dumps (file name ends with the rank).

    When a rank has several files (torch's dump and the watcher's), the one with more entries
    wins for ops, and a note from any is kept.

    Raises:
        DumpError: the directory is missing or empty, or a file is not a dump.
    """
    if not isinstance(directory, str) or not os.path.isdir(directory):
        raise DumpError(f"DUMP_DIR: not a directory: {directory!r}")
    names = sorted(os.listdir(directory))[: MAX_DUMP_FILES + 1]
    if len(names) > MAX_DUMP_FILES:
        raise DumpError(f"DUMP_DIR: more than {MAX_DUMP_FILES} files in {directory!r}")
    by_rank: dict[int, RankRecord] = {}
    for name in names:
        found = _RANK_SUFFIX.search(name)
        path = os.path.join(directory, name)
        if found is None or ".tmp" in name or not os.path.isfile(path):
            continue
        with open(path, "rb") as handle:
            data = handle.read(MAX_INPUT_BYTES + 1)
        dump = load_dump(data, path)
        stated = dump.get("rank")
        rank = stated if isinstance(stated, int) else int(found.group(1))
        rec = record_of_dump(dump, rank, placer, path)
        old = by_rank.get(rank)
        if old is not None:
            best = rec if len(rec.ops) > len(old.ops) else old
            rec = RankRecord(rank, best.ops, note=old.note or rec.note)
        by_rank[rank] = rec
    if not by_rank:
        raise DumpError(f"DUMP_DIR: no dump files (names ending in a rank) in {directory!r}")
    return [by_rank[r] for r in sorted(by_rank)]
