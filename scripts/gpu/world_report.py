"""The GPU check's N-rank part: worlds of :mod:`scripts.gpu.world`, bodies of :mod:`scripts.gpu.world_checks`.

:func:`world_section` runs what a :class:`WorldPlan` selects, for each world size and mode:
``groups`` (compat against MCore on each layout) and ``builders`` in one world, ``training``
(the tiny GPT under MCore then compat, :mod:`scripts.gpu.world_training`) in a world of its
own, then in the bound mode ``death``, a rank's death inside the split sequence (first size
only), and ``death-nonblocking``, the same with ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``
(:mod:`scripts.gpu.world_nonblocking`); then, once per mode in the order given,
:data:`ONCE_CHECKS` (recovery in place, the scale ladder, the sharing policies, sleep and wake). It returns
report lines and ``(check, passed, detail)`` rows. On gloo (the CPU dry run) the same bodies run; the bound mode
there splits through the gloo stand-in. :func:`worst_case_s` bounds a plan's wall time.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from scripts.gpu import world_checks, world_hang, world_nonblocking, world_training
from scripts.gpu.world import WorldError, run_world

#: Seconds of the failure bound in the death runs (``PSNG_FAILURE_TIMEOUT``), and the slack allowed over it.
DEATH_BOUND_S = 20.0
DEATH_SLACK_S = 15.0
#: Seconds allowed per world over its timeout (starting the ranks, killing them after a timeout).
WORLD_SLACK_S = 15.0
#: What an N-rank world checks by default (``--world-checks``).
DEFAULT_WORLD_CHECKS = ("groups", "builders", "training", "death", "death-nonblocking")
#: Checks that run once per mode, in the order given, after the per-size ones: recovery in place
#: (:mod:`scripts.gpu.world_recovery`), the scale ladder (:mod:`scripts.gpu.world_ladder`, its
#: own sizes), the sharing policies (:mod:`scripts.gpu.world_sharing`) and sleep and wake
#: (:mod:`scripts.gpu.world_sleep`), at the first size, and every hang case named
#: (:mod:`scripts.gpu.world_hang`, always 8 ranks).
ONCE_CHECKS = ("recovery", "ladder", "sharing", "sleep", "hang")
WORLD_CHECKS = (*DEFAULT_WORLD_CHECKS, *ONCE_CHECKS)
#: On NCCL, the training world's ranks need a cuBLAS workspace for deterministic algorithms.
TRAINING_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
Check = tuple[str, bool, str]
#: The death checks and the NCCL init mode each runs in (one world each).
_DEATHS = (("death", "blocking"), ("death-nonblocking", "nonblocking"))
#: The slowest world of each kind measured at 8 ranks on one GPU, in seconds (one NVIDIA H200,
#: torch 2.11.0+cu130, NCCL 2.28.9, megatron-core 0.19.2, 2026-11-28; docs/results/gpu-runs/2026-11-28-h200):
#: the bound groups/builders world and the bound training world (both layouts).
MEASURED_8_RANKS_S = {"groups": 51.6, "training": 58.2}
#: Default limits on a GPU: this many times the measured 8-rank time, per size (below).
LIMIT_MARGIN = 2.0
#: Default 8-rank limits of the dry run (gloo on CPUs), where the GPU's times say nothing: on the
#: 2-core machine the 8-rank groups world took 52.7 s and the training world up to 186 s under
#: load (docs/testing.md, "The GPU check's dry runs"); scaled by size / 8 as on a GPU.
DRY_RUN_LIMITS_S = {"groups": 150.0, "training": 300.0}


def default_limit_s(size: int, what: str, backend: str) -> float:
    """The default time limit of one N-rank world (``what``: ``groups``, ``training``, ``death``).

    On NCCL: :data:`LIMIT_MARGIN` times the measured 8-rank time of its kind, scaled by
    ``size / 8`` for larger worlds (their ranks share the one GPU and MCore's world-wide
    ``new_group`` calls grow with the size), rounded up to 10 s: groups 110 s at 8 ranks and
    210 s at 16, training 120 s and 240 s. A death world gets the groups limit. On gloo (the dry
    run): :data:`DRY_RUN_LIMITS_S` at 8 ranks or fewer, scaled by ``size / 8`` above.
    """
    kind = "training" if what == "training" else "groups"
    at_8 = LIMIT_MARGIN * MEASURED_8_RANKS_S[kind] if backend == "nccl" else DRY_RUN_LIMITS_S[kind]
    scaled = at_8 * max(size, 8) / 8
    return float(-(-scaled // 10) * 10)


@dataclass(frozen=True)
class WorldPlan:
    """Which N-rank worlds to run: sizes, modes, checks, training layouts and time limits.

    ``timeout`` bounds each groups/builders world and each death world, ``training_timeout``
    each training world (seconds; a world past its limit fails as a whole, its ranks killed);
    ``None``: :func:`default_limit_s` of each world's size.
    """

    sizes: tuple[int, ...]
    modes: tuple[str, ...] = ("lazy", "bound")
    checks: tuple[str, ...] = WORLD_CHECKS
    training_layouts: tuple[str, ...] = world_training.LAYOUT_NAMES
    timeout: float | None = None
    training_timeout: float | None = None
    recovery_timeout: float = 90.0
    ladder_sizes: tuple[int, ...] = (8, 16, 32, 48, 64)
    ladder_timeout: float = 150.0
    sharing_values: tuple[str, ...] = ("0", "safe", "1")
    sharing_training: str = "safe"
    sharing_timeout: float = 90.0
    sleep_timeout: float = 90.0
    hang_timeout: float = 120.0

    def worlds(self, backend: str) -> list[tuple[int, str, str, float]]:
        """``(size, mode, what, timeout)`` of every world, in the order they run.

        First the per-size worlds (groups/builders, training), then the worlds that run once, in
        the order ``checks`` gives them: the deaths (bound mode, first size) and :data:`ONCE_CHECKS`
        (each mode; recovery and sharing at the first size, the ladder at its own sizes).
        """
        out: list[tuple[int, str, str]] = []
        for size in self.sizes:
            for mode in self.modes:
                if "groups" in self.checks or "builders" in self.checks:
                    out.append((size, mode, "groups"))
                if "training" in self.checks:
                    out.append((size, mode, "training"))
        deaths = dict(_DEATHS)
        for check in self.checks:
            if check in deaths and "bound" in self.modes:
                out.append((self.sizes[0], "bound", f"{check} ({deaths[check]})"))
            elif check in ONCE_CHECKS:
                sizes = {"ladder": self.ladder_sizes[-1], "hang": world_hang.SIZE}
                out += [(sizes.get(check, self.sizes[0]), mode, check) for mode in self.modes]
        return [(size, mode, what, self.limit_s(size, what, backend)) for size, mode, what in out]

    def limit_s(self, size: int, what: str, backend: str) -> float:
        """The time limit of one world: the one given, else :func:`default_limit_s`."""
        once = {
            "recovery": self.recovery_timeout,
            "ladder": self.ladder_timeout,
            "sharing": self.sharing_timeout,
            "sleep": self.sleep_timeout,
            "hang": 1.5 * self.hang_timeout + WORLD_SLACK_S,  # two worlds: the mismatch's gets half
        }
        if what in once:
            return once[what]
        given = self.training_timeout if what == "training" else self.timeout
        return given if given is not None else default_limit_s(size, what, backend)


def worst_case_s(plan: WorldPlan, backend: str) -> float:
    """Seconds the plan's worlds may take at most: each world's timeout plus :data:`WORLD_SLACK_S`."""
    return sum(timeout + WORLD_SLACK_S for *_, timeout in plan.worlds(backend))


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
    if results[0].get("builders") is None:
        return rows
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
    body: Any = world_checks.death
    if nonblocking:
        env, body = world_nonblocking.world_env(DEATH_BOUND_S), world_nonblocking.death_nonblocking
    name = (
        f"{tag} death of rank {victim} at split {at_split} ({'nonblocking' if nonblocking else 'blocking'} NCCL init)"
    )
    start = time.monotonic()
    try:
        results = run_world(
            size,
            body,
            (victim, at_split),
            backend=backend,
            mode=mode,
            timeout=timeout,
            may_die=(victim,),
            env=env,
        )
    except WorldError as err:
        return [(name, False, f"{_failure_summary(err)} after {time.monotonic() - start:.0f} s")]
    if nonblocking:
        return world_nonblocking.rows(tag, size, victim, at_split, DEATH_BOUND_S, DEATH_SLACK_S, results)
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


def _innermost_frame(stacks: str) -> str:
    """The most recent frame of the rank's main thread (the one running ``_rank_main``) in a
    :mod:`faulthandler` dump of every thread; the dump's first line when none is found.
    """
    threads: list[list[str]] = []
    for line in stacks.strip().splitlines():
        if line.startswith(("Thread ", "Current thread ")) or not threads:
            threads.append([])
        threads[-1].append(line.strip())
    main = next((t for t in threads if any("in _rank_main" in x for x in t)), threads[0] if threads else [""])
    return next((x for x in main if x.startswith("File ")), main[0] if main else "")


def _failure_summary(err: WorldError, limit: int = 600) -> str:
    """The first line of a world's failure, then each failed rank's first line (what it raised,
    or that it gave no result) and, for a rank stopped at the timeout, its innermost frame.
    """
    text = str(err)
    parts = [text.splitlines()[0]]
    for block in text.split("\n--- ")[1:]:
        head, _, rest = block.partition("\n")
        found = rest.strip().splitlines() or [""]
        if "stack at the timeout" in head:
            found = [_innermost_frame(rest)]
            head = head.split(":")[0] + " stopped in"
        parts.append(f"{head.rstrip(':')}: {found[0]}"[:240] if found[0] else head.rstrip(":"))
    return "; ".join(parts)[:limit]


def _run_world_rows(
    tag: str, what: str, size: int, backend: str, mode: str, plan: WorldPlan, timeout: float, lines: list[str]
) -> list[Check]:
    """One groups/builders world or one training world; its rows (a failed world: one row)."""
    if what == "training":
        body: Any = world_training.training
        args: tuple = (world_training.training_layouts(size, plan.training_layouts),)
        env = TRAINING_ENV if backend == "nccl" else {}
    else:
        body = world_checks.every_check
        layouts = _layouts(size) if "groups" in plan.checks else {}
        args, env = (layouts, "builders" in plan.checks), {}
    try:
        results = run_world(size, body, args, backend=backend, mode=mode, timeout=timeout, env=env)
    except WorldError as err:
        lines.append(f"FAILED {tag} {what}: {err}"[:6000])
        return [(f"{tag} {what}: the world", False, _failure_summary(err))]
    if what == "training":
        return world_training.training_rows(tag, results)
    return _every_check_rows(tag, "split" if mode == "bound" else "member", results)


def _once_rows(what: str, size: int, backend: str, mode: str, plan: WorldPlan) -> tuple[list[str], list[Check]]:
    """One of :data:`ONCE_CHECKS`: its report lines and rows."""
    from scripts.gpu import world_ladder, world_recovery, world_sharing, world_sleep

    tag = f"{size} ranks {backend} {mode}"
    expected = "split" if mode == "bound" else "member"
    if what == "ladder":
        return world_ladder.ladder_section(
            plan.ladder_sizes, backend, mode, plan.ladder_timeout, f"{backend} {mode}", _failure_summary
        )
    if what == "sleep":
        return world_sleep.sleep_section(size, backend, mode, plan.sleep_timeout, tag, _failure_summary)
    if what == "hang":
        return [], world_hang.hang_section(backend, mode, plan.hang_timeout, run_world, WorldError)
    if what == "sharing":
        return world_sharing.sharing_section(
            size, backend, mode, plan.sharing_values, plan.sharing_training, plan.sharing_timeout, tag, _failure_summary
        )
    victim = world_recovery.victim_of(size)
    env = TRAINING_ENV if backend == "nccl" else {}
    args = (world_recovery.recovery_config(size), victim)
    try:
        results = run_world(
            size,
            world_recovery.recovery,
            args,
            backend=backend,
            mode=mode,
            timeout=plan.recovery_timeout,
            may_die=(victim,),
            env=env,
        )
    except WorldError as err:
        return [f"FAILED {tag} recovery: {err}"[:6000]], [(f"{tag} recovery: the world", False, _failure_summary(err))]
    return [], world_recovery.recovery_rows(tag, victim, expected, results)


def world_section(plan: WorldPlan, backend: str) -> tuple[list[str], list[Check]]:
    """Report lines and check rows for every world of ``plan`` (module docstring)."""
    lines: list[str] = [
        f"worlds: {len(plan.worlds(backend))} ({', '.join(plan.checks)}; modes {', '.join(plan.modes)}); "
        f"worst case {worst_case_s(plan, backend):.0f} s"
    ]
    rows: list[Check] = []
    for size, mode, what, timeout in plan.worlds(backend):
        tag = f"{size} ranks {backend} {mode}"
        start = time.monotonic()
        if what.startswith("death"):
            rows += _death_rows(tag, size, backend, mode, what.startswith("death-nonblocking"), timeout)
        elif what in ONCE_CHECKS:
            more, found = _once_rows(what, size, backend, mode, plan)
            lines += more
            rows += found
        else:
            rows += _run_world_rows(tag, what, size, backend, mode, plan, timeout, lines)
        lines.append(f"{tag} {what}: {time.monotonic() - start:.1f} s")
        print(lines[-1], file=sys.stderr, flush=True)  # progress, in case the call is stopped
    return lines, rows
