"""The GPU check's N-rank part: worlds of :mod:`scripts.gpu.world`, bodies of :mod:`scripts.gpu.world_checks`.

:func:`world_section` runs, for each world size and mode, one world with every check (compat
against MCore on each layout, the builders), then in the bound mode a rank's death inside the
split sequence (first size only), with ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` and without; it returns report lines
and ``(check, passed, detail)`` rows. On gloo (the CPU dry run) the same bodies run; the bound
mode there splits through the gloo stand-in.
"""

from __future__ import annotations

import time
from typing import Any

from scripts.gpu import world_checks
from scripts.gpu.world import WorldError, run_world

#: Seconds of the failure bound in the death runs (``PSNG_FAILURE_TIMEOUT``), and the slack allowed over it.
DEATH_BOUND_S = 20.0
DEATH_SLACK_S = 15.0
Check = tuple[str, bool, str]


def _layouts(size: int) -> dict[str, dict[str, Any]]:
    return (
        world_checks.LAYOUTS
        if size >= 8
        else {"tp2 pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}
    )


def _every_check_rows(tag: str, expected_path: str, results: list[dict[str, Any]]) -> list[Check]:
    rows: list[Check] = []
    for label in results[0]["layouts"]:
        per_rank = [r["layouts"][label] for r in results]
        paths = sorted({r["creation_path"] for r in per_rank})
        rows.append((f"{tag} {label}: creation path", paths == [expected_path], f"{paths} (expected {expected_path})"))
        bad = {r["rank"]: r["member_mismatches"] for r in per_rank if r["member_mismatches"]}
        compared = sum(r["getters_compared"] for r in per_rank)
        rows.append(
            (
                f"{tag} {label}: membership equals MCore's",
                not bad,
                f"{compared} (rank, getter) pairs; {bad or 'no difference'}",
            )
        )
        mism = sum(r["mismatches"] for r in per_rank)
        rows.append(
            (
                f"{tag} {label}: NCCL options and timeouts equal MCore's",
                mism == 0,
                f"{mism} mismatch(es) over {sum(r['mcore_calls'] for r in per_rank)} MCore calls (all ranks)"
                + "".join(
                    f"; rank {r['rank']}: {text}"
                    for r in [x for x in per_rank if x.get("mismatch_samples")][:1]
                    for text in r["mismatch_samples"]
                ),
            )
        )
        used = all(r["counts"].get("touched", 0) == r["counts"]["after_init"] - r["counts"]["before"] for r in per_rank)
        freed = all(r["counts"]["after_destroy"] == r["counts"]["before"] for r in per_rank)
        c0, r0 = per_rank[0]["counts"], per_rank[0]
        detail = (
            f"rank 0: {c0['before']} -> {c0['after_init']} -> {c0['after_destroy']} groups, {c0.get('touched')} used; "
            f"free MiB {c0.get('free_mib_before')} -> {c0.get('free_mib_after_init')} -> "
            f"{c0.get('free_mib_after_destroy')}; calls {r0['compat_calls_by_kind']}; MCore left {r0['mcore_leaked']}; "
            f"slowest rank {max(r['seconds'] for r in per_rank)} s"
        )
        rows.append((f"{tag} {label}: every group all-reduced, destroy frees all", used and freed, detail))
    b = [r["builders"] for r in results]
    paths = sorted({r["creation_path"] for r in b})
    ok = paths == [expected_path] and all(r["megatron_sums_ok"] and r["grid_sums_ok"] and r["left"] == 0 for r in b)
    sums = all(r["megatron_sums_ok"] and r["grid_sums_ok"] for r in b)
    detail = f"path {paths}; sums ok {sums}; groups left {[r['left'] for r in b]}"
    rows.append((f"{tag}: build_megatron_groups and HyperCommGrid", ok, detail))
    return rows


def _death_rows(tag: str, size: int, backend: str, mode: str, nonblocking: bool, timeout: float) -> list[Check]:
    victim, at_split = size - 1, 3
    env = {"PSNG_FAILURE_TIMEOUT": str(int(DEATH_BOUND_S))}
    if nonblocking:
        env["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"
    name = (
        f"{tag} death of rank {victim} at split {at_split} ({'nonblocking' if nonblocking else 'blocking'} NCCL init)"
    )
    start = time.monotonic()
    try:
        results = run_world(
            size,
            world_checks.death,
            (victim, at_split),
            backend=backend,
            mode=mode,
            timeout=timeout,
            may_die=(victim,),
            env=env,
        )
    except WorldError as err:
        return [(name, False, f"{str(err).splitlines()[0]} after {time.monotonic() - start:.0f} s")]
    survivors = [r for r in results if r is not None]
    raised = all(r["raised"] and r.get("names_victim") for r in survivors)
    slowest = max(r["seconds"] for r in survivors)
    in_bound = slowest <= DEATH_BOUND_S + DEATH_SLACK_S
    usable = all(r.get("new_world_sum") == size - 1 for r in survivors)
    kinds = sorted({str(r["raised"]) for r in survivors})
    detail = (
        f"survivors raised {kinds}, naming rank {victim}: {raised}; slowest {slowest} s "
        f"(bound {DEATH_BOUND_S:.0f} s); new world of {size - 1} all-reduced: {usable}"
    )
    errors = [r["new_world_error"].splitlines()[0] for r in survivors if "new_world_error" in r]
    if errors:
        detail += f"; new world errors: {errors[:2]}"
    if not survivors[0].get("names_victim"):
        detail += f"; rank 0 said: {survivors[0].get('message')}"
    return [(name, raised and in_bound and usable, detail)]


def world_section(
    sizes: list[int], modes: tuple[str, ...], backend: str, timeout: float
) -> tuple[list[str], list[Check]]:
    """Report lines and check rows for every world size and mode (module docstring)."""
    lines: list[str] = []
    rows: list[Check] = []
    for size in sizes:
        for mode in modes:
            tag = f"{size} ranks {backend} {mode}"
            expected = "split" if mode == "bound" else "member"
            start = time.monotonic()
            try:
                results = run_world(
                    size, world_checks.every_check, (_layouts(size),), backend=backend, mode=mode, timeout=timeout
                )
                rows += _every_check_rows(tag, expected, results)
            except WorldError as err:
                rows.append((f"{tag}: the world", False, str(err).splitlines()[0]))
                lines.append(f"FAILED {tag}: {err}"[:4000])
            lines.append(f"{tag}: {time.monotonic() - start:.1f} s")
            if mode == "bound" and size == sizes[0]:  # the death at the first size only (time)
                for nonblocking in (True, False):
                    start = time.monotonic()
                    rows += _death_rows(tag, size, backend, mode, nonblocking, timeout)
                    how = "nonblocking" if nonblocking else "blocking"
                    lines.append(f"{tag} death ({how}): {time.monotonic() - start:.1f} s")
                    if backend == "gloo":
                        break  # the NCCL setting means nothing on gloo
    return lines, rows
