"""The group-sharing policies on one GPU: memory and time per ``PSNG_SHARE_GROUPS`` value, and training.

:func:`sharing_section` runs one world (8 ranks on the GPU) whose ranks do
:func:`sharing`: first :func:`scripts.gpu.world_usable.usable_groups` at tp2 pp2 ep2 (the
layout where ``PSNG_SHARE_GROUPS=1`` shares most; tp1 at 4 ranks, the dry run) for MCore
and for compat under each value of ``PSNG_SHARE_GROUPS`` (``unset``: the variable removed), so
time to usable groups, creation calls and the device memory the groups hold stand side by side;
then the tiny GPT of :mod:`scripts.gpu.world_training` under MCore and under compat with
``PSNG_SHARE_GROUPS`` set to the training value (``safe`` in the prepared call), which must be
bit-identical.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from scripts.gpu import world_training
from scripts.gpu.world import RankContext, WorldError, run_world
from scripts.gpu.world_usable import Case, nccl_log_env, summary, summary_text, usable_groups, usable_sizes

ENV = "PSNG_SHARE_GROUPS"
UNSET = "unset"
Check = tuple[str, bool, str]


def cases(values: tuple[str, ...]) -> list[Case]:
    """MCore, then compat under each value (``unset`` removes the variable)."""
    mcore: Case = ("MCore", "mcore", {ENV: None})
    return [mcore] + [(f"compat {ENV}={v}", "compat", {ENV: None if v == UNSET else v}) for v in values]


def sharing(ctx: RankContext, values: tuple[str, ...], training_value: str, layouts: dict[str, Any]) -> dict[str, Any]:
    """On this rank: :func:`usable_groups` for :func:`cases`, then :func:`world_training.training`
    of ``layouts`` with ``PSNG_SHARE_GROUPS=training_value`` (``""``: no training).
    """
    out = {"usable": usable_groups(ctx, usable_sizes(ctx.world_size), cases(values)), "training": None}
    if training_value:
        saved = os.environ.get(ENV)
        if training_value == UNSET:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = training_value
        try:
            out["training"] = world_training.training(ctx, layouts)
        finally:
            os.environ.pop(ENV, None)
            if saved is not None:
                os.environ[ENV] = saved
    return out


def sharing_section(
    size: int,
    backend: str,
    mode: str,
    values: tuple[str, ...],
    training_value: str,
    timeout: float,
    tag: str,
    failure: Callable[[WorldError], str],
) -> tuple[list[str], list[Check]]:
    """Run the sharing world (module docstring); report lines and ``(check, passed, detail)`` rows."""
    layouts = world_training.training_layouts(size, ("dense",)) if training_value else {}
    env: dict[str, str] = {}
    logs = tempfile.mkdtemp(prefix="psng-sharing-")
    if backend == "nccl":
        env = {**nccl_log_env(logs), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    start = time.monotonic()
    lines = [f"{tag} sharing: {ENV} in {list(values)}, tp2 pp2 ep2; training under {ENV}={training_value or '-'}"]
    try:
        results = run_world(
            size, sharing, (values, training_value, layouts), backend=backend, mode=mode, timeout=timeout, env=env
        )
    except WorldError as err:
        return [*lines, f"FAILED {tag} sharing: {err}"[:6000]], [(f"{tag} sharing: the world", False, failure(err))]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    usable = [r["usable"] for r in results]
    rows: list[Check] = []
    for label, _, _ in cases(values):
        s = summary(usable, label)
        lines.append(f"  {summary_text(label, s)}")
        rows.append(
            (
                f"{tag} sharing {label}: every getter's group all-reduced",
                s["ok"],
                f"usable in {s['usable_s']:.2f} s; {s['calls']} calls per rank; groups hold "
                + ("- (no device)" if s["held_mib"] is None else f"{s['held_mib']} MiB"),
            )
        )
    if training_value:
        rows += world_training.training_rows(f"{tag} {ENV}={training_value}", [r["training"] for r in results])
    lines.append(f"{tag} sharing world: {time.monotonic() - start:.1f} s")
    return lines, rows
