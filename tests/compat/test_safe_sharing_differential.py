"""compat under ``PSNG_SHARE_GROUPS=safe`` against compat without sharing, over the differential plan.

Megatron's own ``tests/unit_tests/test_parallel_state.py`` is not in the release wheels (they ship
``megatron/`` only), so the closest check this project has stands in: the differential plan of
``tests/compat/test_compat_differential.py`` (every argument of the installed release's
``initialize_model_parallel``, world sizes 1 ... 1024, several ranks each, the fake backend),
observed once without sharing and once with the environment variable set to ``safe``. Every
outcome must be the same (the same exceptions, members, rank lists, ranks, sizes, return
values and module globals after init, after the setters and after destroy) except what sharing
changes by design: which getters return one object (``alias:`` keys), the ``group_desc`` a
shared group keeps (its first kind's; timeout and options must be equal), and
``_global_process_group_list``, which lists a shared group once. An eighth of the plan a run
(rotating, tests/support/rotation.py); every part with ``PSNG_TEST_ROTATION=all``.
"""

from __future__ import annotations

import warnings

import pytest

from parallel_state_ng.groups import sharing
from tests.support import rotation
from tests.support.differential import library as D
from tests.support.differential.plans import all_configs
from tests.support.differential.run import run_side

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

PARTS = 8
CONFIGS = [cfg for part in rotation.parts_to_run(PARTS) for cfg in all_configs()[part::PARTS] if not cfg.deliberate]


def _by_design(diff: D.Difference) -> bool:
    """A difference sharing makes by design (see the module docstring)."""
    key = diff.key
    for phase in ("after_setters:", "after_init_state:"):  # the same observables, later in the run
        key = key.removeprefix(phase)
    if key.startswith("alias:") or key == "global:_global_process_group_list":
        return True
    if key.startswith("meta:"):  # (group_desc, timeout, backend, options): only the desc may differ
        ref, other = diff.reference, diff.other
        return isinstance(ref, tuple) and isinstance(other, tuple) and ref[1:] == other[1:]
    return False


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_safe_changes_only_identities(cfg, tmp_path, monkeypatch):
    import compat.parallel_state as compat_ps

    monkeypatch.setattr(sharing, "_override", None)  # the environment decides, as in a job
    for rank in cfg.ranks():
        monkeypatch.delenv(sharing.ENV_SHARE, raising=False)
        off = run_side(compat_ps, cfg, rank, tmp_path)
        monkeypatch.setenv(sharing.ENV_SHARE, "safe")
        safe = run_side(compat_ps, cfg, rank, tmp_path)
        assert D.equivalent(off.outcome, safe.outcome), (rank, off.outcome, safe.outcome)
        if off.outcome != "ok":
            continue
        unexpected = [d for d in D.compare(off.comparable(), safe.comparable()) if not _by_design(d)]
        assert not unexpected, f"rank {rank}:\n" + D.describe(unexpected)
        assert not D.destroy_differences(off.after_destroy, safe.after_destroy), rank
