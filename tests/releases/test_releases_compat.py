"""compat against every supported Megatron-Core release, each in its own process.

For each release (0.12.3, 0.13.1, 0.14.0, 0.15.3, 0.16.1, 0.17.1, 0.18.2, 0.19.2) one subprocess bound to it
(``tests.support.releases.wheels.run_in_release``) runs ``tests.support.releases.compat_checks.run``: compat must serve
that release (picked from ``importlib.metadata``) and match its API both ways, its
``initialize_model_parallel`` on the differential configurations (every getter and global, on
several ranks of worlds up to 1,024 ranks; one tenth of the plan per run, rotating by the day,
every part with ``PSNG_TEST_ROTATION=all``) and its rejections of bad input. The child returns
counts and problem lists; this side asserts the counts reach the plan (a silently empty run
fails) and the problem lists are empty.

The release installed in this interpreter is also compared in-process by
``tests/compat/test_compat_differential.py`` with the full plan (``configs.WORLD_PLAN``, 321
configurations on 0.16.1); its subprocess here runs the API, helper and bad-input checks and a
differential sample only, not the same plan twice.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest

from parallel_state_ng.releases import ENV_VAR, installed_megatron_version
from tests.support import rotation
from tests.support.differential import library as D
from tests.support.releases import compat_checks, wheels

VERSIONS = list(wheels.RELEASES.values())
INSTALLED = installed_megatron_version()
# Differential configurations of the installed release's subprocess (the full plan runs in-process).
INSTALLED_SAMPLE = 20
# Each other release's differential plan is split in PARTS (every PARTS-th configuration from the
# part's index): a default run covers the part of the day (tests/support/rotation.py), so that
# consecutive CI runs cover the whole plan; PSNG_TEST_ROTATION=all runs every part, each as its own
# test that pytest's workers share. The API, helper and bad-input sections run with every part of
# the day, and with part 0 of a full run.
PARTS = 10
CASES = [
    pytest.param(version, part, id=f"{version}-part{part + 1}of{PARTS}")
    for version in VERSIONS
    if version != INSTALLED
    for part in rotation.parts_to_run(PARTS)
] + (
    # The installed release through the same subprocess harness, one run in three: its full plan,
    # API, helpers and bad input run in-process in every run (tests/compat).
    [pytest.param(INSTALLED, 0, id=f"{INSTALLED}-installed-sample")] if rotation.runs_today(0, 3) else []
)

# Minimum counts per section; the plan gives more (the child reports what it ran). The smallest
# release API is 0.14's (79 functions, 47 globals; 0.12: 86 and 47), the fewest bad inputs 0.14's
# (107; 0.12: 123), the fewest helper cases 0.14's (24).
MIN_FUNCTIONS, MIN_GLOBALS, MIN_BAD_INPUTS = 70, 40, 100
MIN_RANK_GENERATOR_CASES, MIN_HELPER_CASES = 12, 20
MIN_CONFIGS, MIN_RANKS_PER_CONFIG = 100, 3
# Per feature the release has: GTP (0.19), sub-world (0.17+), all-gather groups after init (0.18+),
# an encoder block and a pipeline split rank (0.12/0.13; ~45 and ~25 configurations).
MIN_FEATURE_CONFIGS = 10


def _summary(version: str, result: dict, wall: float) -> str:
    parts = [
        f"megatron-core {version}: {wall:.1f} s wall (child {result.get('seconds')} s, "
        f"{result.get('cpu_seconds')} s CPU)"
    ]
    for section in ("api", "differential", "helpers", "bad_input"):
        info = {k: v for k, v in result.get(section, {}).items() if k != "problems"}
        parts.append(f"  {section}: {json.dumps(info)}; problems: {len(result.get(section, {}).get('problems', []))}")
    return "\n".join(parts)


def _problems(result: dict, limit: int = 40) -> str:
    lines = []
    for section in ("api", "differential", "helpers", "bad_input"):
        problems = result.get(section, {}).get("problems", [])
        if problems:
            lines.append(f"== {section}: {len(problems)} problem(s)")
            lines.extend("  " + p.replace("\n", "\n    ")[:1500] for p in problems[:limit])
            if len(problems) > limit:
                lines.append(f"  ... and {len(problems) - limit} more")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize(("version", "part"), CASES)
def test_compat_serves_release(version, part):
    """API (both directions), differential (one part) and bad input of compat against one release."""
    full = version != INSTALLED
    shards = PARTS if full else 1
    lead = not rotation.every_part() or part == 0
    start = time.perf_counter()
    result = wheels.run_in_release(
        version,
        "tests.support.releases.compat_checks",
        "run",
        version,
        compat_checks.RELEASE_PLAN,
        True,
        10_000 if full else INSTALLED_SAMPLE,
        part,
        shards,
        lead,
        env={ENV_VAR: ""},  # compat must pick the release from importlib.metadata, not an override
    )
    wall = time.perf_counter() - start
    print("\n" + _summary(version, result, wall))
    assert "problems" not in result, result["problems"]  # bound to the wrong release

    sections = ("api", "differential", "bad_input", "helpers") if lead else ("differential",)
    assert all(key in result for key in sections), f"sections missing from the child's report: {sorted(result)}"
    api, diff, bad, helpers = (result.get(key, {}) for key in ("api", "differential", "bad_input", "helpers"))
    counts = []
    if "helper_cases" in helpers:
        counts += [
            ("RankGenerator cases", helpers["rank_generator_cases"], MIN_RANK_GENERATOR_CASES),
            ("helper cases", helpers["helper_cases"], MIN_HELPER_CASES),
        ]
    if "functions" in api:
        counts += [("api functions", api["functions"], MIN_FUNCTIONS), ("api globals", api["globals"], MIN_GLOBALS)]
    if "cases" in bad:
        counts.append(("bad-input cases", bad["cases"], MIN_BAD_INPUTS))
    if "configs" in diff:
        if full:
            counts += [
                ("differential configs", diff["configs"], MIN_CONFIGS // shards),
                ("differential runs", diff["runs"], MIN_RANKS_PER_CONFIG * MIN_CONFIGS // shards),
                # every part reaches a world of 64+ ranks; the whole plan one of 1,024
                ("largest world", diff["max_world"], 1024 if shards == 1 else 64),
            ]
            for feature, present in diff["features"].items():
                if present:  # the whole plan has enough of them; a part holds its share, which may be none
                    counts.append((f"plan configs with {feature}", diff[f"plan_with_{feature}"], MIN_FEATURE_CONFIGS))
        else:
            counts.append(("differential configs", diff["configs"], INSTALLED_SAMPLE))
    short = [f"{name}: {got} < {want}" for name, got, want in counts if got < want]
    problems = _problems(result)
    assert not short and not problems, "\n".join(
        [_summary(version, result, wall), *(["counts below plan: " + "; ".join(short)] if short else []), problems]
    )


@pytest.mark.network
def test_not_getters_are_known_to_some_release():
    """Every name in differential.NOT_GETTERS is a function of at least one supported release."""
    functions, _ = compat_checks.known_release_names()
    assert len(functions) >= 90
    stale = sorted(set(D.NOT_GETTERS) - functions)
    assert not stale, f"differential.NOT_GETTERS names no release's function: {stale}"


def test_release_names_are_read_from_the_sources():
    """The ast reading of a release's parallel_state.py finds what importing it finds (installed one)."""
    import megatron.core.parallel_state as installed

    functions, state = compat_checks._release_names(Path(inspect.getfile(installed)))
    assert functions >= set(D.reference_functions())
    assert set(D.reference_globals()) <= state
    assert "_TENSOR_MODEL_PARALLEL_GROUP" in state and "initialize_model_parallel" in functions
