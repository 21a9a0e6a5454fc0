"""Running a differential configuration on the reference and on compat, and comparing.

:func:`compare_config` runs one :class:`configs.Config` on both modules for every compared
rank and returns the failures; the in-process test (installed release,
``tests/compat/test_compat_differential.py``) and the per-release test (``tests/support/releases/compat_checks.py``, one
subprocess per release) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import megatron.core.parallel_state as mcore_ps

from tests.support.differential import library as D
from tests.support.differential.configs import YAMLS, Config, reference_release

# --------------------------------------------------------------------------- running


def init_kwargs(cfg: Config, tmp_path: Path) -> dict[str, Any]:
    """``cfg.kwargs`` with the NCCL config file (if any) written under ``tmp_path``."""
    kw = dict(cfg.kwargs)
    if cfg.yaml is not None:
        path = Path(tmp_path) / f"nccl_{cfg.yaml}.yaml"
        if YAMLS[cfg.yaml] is not None:
            path.write_text(YAMLS[cfg.yaml])
        kw["nccl_communicator_config_path"] = str(path)
    return kw


def run_side(ps: Any, cfg: Config, rank: int, tmp_path: Path, **options) -> D.Observation:
    """Fresh fake world of ``cfg.world`` ranks as ``rank``; observe one init of ``ps``."""
    D.fake_world(rank, cfg.world)
    return D.observe(
        ps, rank, init_kwargs(cfg, tmp_path), env=cfg.env, cuda_stub=cfg.cuda_stub, after_init=cfg.after_init, **options
    )


@dataclass
class Tally:
    """What one process compared."""

    configs: int = 0
    runs: int = 0  # configuration x rank pairs
    valid_runs: int = 0
    mismatches: list[str] = field(default_factory=list)  # ids of mismatching configurations
    mcore_leftovers: dict[str, set] = field(default_factory=dict)  # exception -> globals left set
    env_on_failure: dict[str, tuple] = field(default_factory=dict)


def _left_set(state: dict[str, Any]) -> set:
    return {k[len("global:") :] for k, v in state.items() if k.startswith("global:") and v not in (None, ("dict", ()))}


def compare_config(compat_ps: Any, cfg: Config, tmp_path: Path, tally: Tally) -> list[str]:
    """Compare compat with the reference on every rank of ``cfg``; return the failures (empty: equal).

    A configuration the reference rejects must be rejected by compat with the same type (or a
    subclass), and compat's state must then be what it was before (atomic). Documented
    deliberate differences (``cfg.deliberate``) are checked for what they promise instead.
    """
    tally.configs += 1
    failures: list[str] = []
    for rank in cfg.ranks():
        ref = run_side(mcore_ps, cfg, rank, tmp_path)
        got = run_side(compat_ps, cfg, rank, tmp_path, snapshot_before=True)
        tally.runs += 1
        if cfg.deliberate == "rejects":
            if ref.outcome != "ok":
                failures.append(f"rank {rank}: MCore was expected to accept it: {ref.error_message}")
            elif got.outcome == "ok" or got.outcome[1] != "ValueError" or cfg.deliberate_arg not in got.error_message:
                failures.append(
                    f"rank {rank}: compat should refuse with a ValueError naming {cfg.deliberate_arg}, "
                    f"got {got.error_message or 'ok'}"
                )
            elif D.compare(got.before, got.state):
                failures.append(f"rank {rank}: compat must stay untouched when it refuses")
            continue
        if D.equivalent(ref.outcome, got.outcome):
            diffs = D.compare(ref.comparable(), got.comparable())
            if cfg.deliberate == "barrier-once":
                diffs = [
                    d for d in diffs if not d.key.startswith("init:barriers") and not d.key.startswith("init:cuda")
                ]
                if not (len(set(got.barriers)) == len(got.barriers) <= 1 and set(got.barriers) == set(ref.barriers)):
                    failures.append(f"rank {rank}: barriers MCore {ref.barriers}, compat {got.barriers}")
        else:  # one side raised (or raised another type): the outcome is the difference
            diffs = [D.Difference("init:outcome", ref.outcome, got.outcome)]
        if ref.outcome == "ok" and got.outcome == "ok":
            left = D.destroy_differences(ref.after_destroy, got.after_destroy)
            if left:
                failures.append(f"rank {rank}: after destroy_model_parallel:\n" + D.describe(left))
        if cfg.hand_written and (ref.outcome != "ok") != cfg.expected_invalid:
            failures.append(
                f"rank {rank}: the test expects MCore {reference_release()} to "
                f"{'reject' if cfg.expected_invalid else 'accept'} it; MCore says "
                f"{ref.error_message or 'ok'}"
            )
        if ref.outcome != "ok":
            exc = ref.outcome[1]
            tally.mcore_leftovers.setdefault(exc, set()).update(_left_set(ref.state))
            if ref.env:
                tally.env_on_failure[cfg.id] = (ref.env, got.env)
            if got.outcome != "ok":  # compat failed too: it must not have changed its state
                atomic = D.compare(got.before, got.state)
                if atomic:
                    failures.append(
                        f"rank {rank}: compat is not atomic after {got.error_message!r}:\n" + D.describe(atomic)
                    )
        else:
            tally.valid_runs += 1
        if diffs:
            failures.append(
                f"rank {rank} (MCore: {ref.error_message or 'ok'}; compat: {got.error_message or 'ok'}):\n"
                + D.describe(diffs)
            )
    if failures:
        tally.mismatches.append(cfg.id)
    return failures
