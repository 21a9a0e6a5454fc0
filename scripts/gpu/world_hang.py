"""The hang check on 8 ranks of one GPU (NCCL) or of gloo (the dry run): every stall case named.

The cases and the per-rank body are :mod:`scripts.examples.hang`'s (the CPU tests' too), with
tensors on the rank's device. One world runs :data:`SHARED_WORLD_CASES` one after another (each
initializes compat, watches with a 1 s bound, stalls one rank, releases it once the report is in
the store, destroys); the mismatch runs last in a world of its own, whose ranks may end at the
groups' timeout (on NCCL the watchdog may end the process). The parent then reads each case's
report (written by the reporting rank beside the dumps) and runs ``parallel-state-ng diagnose``
on the dumps: each row passes when both name the case's culprit, kind and coordinates.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from scripts.examples.hang import CASES, REPORT_FILE, names_case, offline, stall_case

#: The cases that share one world, in the order run; ``mismatch`` gets its own world after them.
SHARED_WORLD_CASES = ("tp", "pp", "dp", "ep", "loader")
#: The world size of every case (the cases' culprits are ranks of 8).
SIZE = 8
#: The watch's bound in the GPU check, seconds.
BOUND_S = 1.0
Check = tuple[str, bool, str]


def hang(ctx: Any, cases: tuple[str, ...], root: str, bound_s: float = BOUND_S) -> dict[str, Any]:
    """One rank: each case in turn, its dumps under ``root/CASE``; this rank's marks by case."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for case in cases:
        folder = os.path.join(root, case)
        os.makedirs(folder, exist_ok=True)
        found = stall_case(case, folder, None, bound_s, ctx.device)
        out[case] = {k: v for k, v in found.items() if k != "report"}
        dist.barrier()
    return out


def hang_rows(tag: str, root: str, results: list[Any], cases: tuple[str, ...]) -> list[Check]:
    """A row per case: the live report (the file the reporting rank wrote) and the offline one."""
    rows: list[Check] = []
    for case in cases:
        _, culprit, _, where = CASES[case]
        folder = os.path.join(root, case)
        path = os.path.join(folder, REPORT_FILE)
        live = open(path, encoding="utf-8").read().splitlines()[0] if os.path.exists(path) else "(no report)"
        code, text = offline(folder, case) if os.path.isdir(folder) else (2, "(no dumps)")
        first = text.splitlines()[0] if text else ""
        ok = names_case(live, case) and names_case(first, case) and code == 0
        marks = (results[culprit] or {}).get(case, {}) if culprit < len(results) else {}
        after = marks.get("report_after_s")
        timing = f"report {after:.1f} s after the stall; " if isinstance(after, float) else ""
        name = f"{tag} hang {case}: rank {culprit} named, {where}"
        rows.append((name, ok, f"{timing}live: {live} | offline: {first}"))
    return rows


def hang_section(backend: str, mode: str, timeout: float, run_world: Any, world_error: type) -> list[Check]:
    """Both worlds of the check (the shared one, then the mismatch's); their rows."""
    tag = f"{SIZE} ranks {backend} {mode}"
    rows: list[Check] = []
    for cases, limit, may_die in (
        (SHARED_WORLD_CASES, timeout, ()),
        (("mismatch",), timeout / 2, tuple(range(SIZE))),
    ):
        root = tempfile.mkdtemp(prefix="psng-hang-")
        try:
            results = run_world(SIZE, hang, (cases, root), backend=backend, mode=mode, timeout=limit, may_die=may_die)
        except world_error as err:
            results = [None] * SIZE
            rows.append((f"{tag} hang {','.join(cases)}: the world", False, str(err)[:600]))
        rows += hang_rows(tag, root, results, cases)
    return rows
