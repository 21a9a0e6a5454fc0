"""The core training example (``scripts/examples/gpt/training.py``) on every supported release.

The installed megatron-core runs the full layout matrix in ``test_train_gpt.py``; here every
other release of :data:`RELEASES` (0.12 ... 0.19) trains one small layout from its unzipped
wheel, in fresh processes of its own: 2 ranks, pipeline parallel 2 with 2 virtual stages per
rank (the interleaved schedule; the part of the API that changed between releases: 0.12 has
no ``vp_stage=`` and sets the virtual pipeline rank instead). compat installed before
megatron's import, MCore's own parallel_state and compat installed after must give
bit-identical losses, gradient norms and final parameters, and the run must really have used
that release.
"""

from __future__ import annotations

import importlib.metadata
import math

import pytest

from scripts.examples.gpt.config import TrainConfig
from tests.support import rotation
from tests.support.releases.wheels import RELEASES, release_dir

try:
    INSTALLED = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - CI installs it
    INSTALLED = None

# The releases other than the installed one; 0.19.2 in every run, the rest rotating in 3 parts
# (tests/support/rotation.py; PSNG_TEST_ROTATION=all: every release).
OTHER_RELEASES = rotation.sample([v for v in RELEASES.values() if v != INSTALLED], keep={RELEASES["0.19"]}, parts=3)
VARIANTS = ("compat-before", "mcore", "compat-after")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("version", OTHER_RELEASES)
def test_core_loop_trains_bit_identically_on_release(version):
    from parallel_state_ng.testing.worlds import GlooWorld
    from scripts.examples.gpt import training as gpt_training

    cfg = TrainConfig(tp=1, pp=2, vpp=2, steps=2, megatron_path=str(release_dir(version)))
    world = GlooWorld(cfg.world_size)
    try:
        results = world.run(gpt_training.train_variants, [cfg], VARIANTS, timeout=600)
    finally:
        world.close()
    for rank, by_variant in enumerate(results):
        reference = by_variant["mcore"][0]
        assert reference["facts"]["version"] == version
        assert reference["facts"]["schedules.parallel_state"] == "megatron.core.parallel_state"
        for variant in ("compat-before", "compat-after"):
            run = by_variant[variant][0]
            assert run["facts"]["version"] == version
            assert run["facts"]["schedules.parallel_state"] == "compat.parallel_state", variant
            assert run["leaked_groups"] == 0, (variant, rank)
            for key in ("losses", "grad_norms", "digest", "params"):
                assert run[key] == reference[key], f"{version}, rank {rank}: {variant} {key} differs from MCore"
    losses = results[-1]["mcore"][0]["losses"]  # the last pipeline stage reports them
    assert len(losses) == cfg.steps and all(math.isfinite(x) and 0 < x < 2 * math.log(cfg.vocab) for x in losses)
