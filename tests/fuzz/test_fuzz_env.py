"""Fuzz the ``PSNG_*`` environment variables through the functions that read them.

Contract: a value is accepted or refused with ``ValueError`` naming the variable; never another
exception, never a NaN or infinite timeout.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from hypothesis import given

from parallel_state_ng.groups import agreement, creation, liveness, nvlink_check, sharing, split
from parallel_state_ng.releases import select_release
from tests.fuzz.strategies import env_values, fuzz_settings

pytestmark = pytest.mark.slow  # a time-boxed fuzz run: docs/testing.md

# variable -> the function that reads it
READERS: dict[str, Callable[[], Any]] = {
    "PSNG_AGREEMENT_CHECK": agreement.agreement_check_settings,
    "PSNG_AGREEMENT_TIMEOUT": agreement.agreement_check_settings,
    "PSNG_NVLINK_CHECK": nvlink_check.nvlink_check_settings,
    "PSNG_NVLINK_KEEP_INSIDE": nvlink_check.nvlink_check_settings,
    "PSNG_NVLINK_DOMAIN": nvlink_check.local_domain_id,
    "PSNG_SHARE_GROUPS": sharing.group_sharing_mode,
    "PSNG_CREATION_PATH": split.creation_path,
    "PSNG_FAILURE_TIMEOUT": liveness.failure_timeout,
    "PSNG_DESTROY_SETTLE_TIMEOUT": lambda: liveness.env_seconds(creation.ENV_SETTLE_TIMEOUT, 30.0),
    "PSNG_MEGATRON_VERSION": select_release,
}


def _numbers(value: Any) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    if isinstance(value, tuple):
        return [n for v in value for n in _numbers(v)]
    return []


@pytest.mark.parametrize("variable", sorted(READERS))
@fuzz_settings(40)
@given(value=env_values)
def test_environment_variable(variable: str, value: str) -> None:
    with mock.patch.dict(os.environ, {variable: value}):
        try:
            result = READERS[variable]()
        except ValueError as err:
            assert variable in str(err) or "version" in str(err).lower(), str(err)[:300]
            assert "\n" not in str(err), str(err)[:300]
        else:
            assert all(math.isfinite(n) for n in _numbers(result)), result
