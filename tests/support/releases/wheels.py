"""Megatron-Core releases for tests: fetch each release's wheel once, run code against it.

Every supported release's ``parallel_state.py`` / ``hyper_comm_grid.py`` /
``process_groups_config.py`` is the specification compat is checked against. Only one
megatron-core can be installed, so tests get the others from their wheels (:data:`RELEASES`,
:func:`release_dir`, from :mod:`tests.support.releases.fetch`) and run code bound to one of them (:func:`run_in_release`; the binding is
:mod:`tests.support.releases.binding`, the processes come from
:mod:`tests.support.releases.forkserver`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.support.paths import ROOT  # the repository root: tests.support imports from there
from tests.support.releases import binding, forkserver
from tests.support.releases.fetch import LEGACY_RELEASES, RELEASES, cache_root, release_dir

__all__ = ["LEGACY_RELEASES", "RELEASES", "cache_root", "release_dir", "run_in_release"]


def run_in_release(
    version: str,
    module: str,
    function: str,
    *args: Any,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> Any:
    """Run ``module.function(*args)`` in a new process bound to megatron-core ``version``.

    ``module`` is a fully qualified name (``tests.support.releases.compat_checks``,
    ``tests.releases.test_install_releases``): the child has the repository root on its
    ``PYTHONPATH``. Arguments and the return value travel as JSON. A failure in the child raises ``RuntimeError`` with
    its output.

    The process is forked from a zygote that has imported torch and the release's
    ``parallel_state`` (:mod:`tests.support.releases.forkserver`): a process of its own per call,
    without paying the imports again. ``fresh=True`` (or ``$PSNG_RELEASE_FORK=0``) starts a new
    interpreter instead.
    """
    dest = release_dir(version)
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join([ROOT, child_env.get("PYTHONPATH", "")])
    child_env.setdefault("OMP_NUM_THREADS", "1")
    done = None
    if not fresh:
        done = forkserver.call(str(dest), module, function, list(args), child_env, timeout)
    if done is None:
        payload = json.dumps({"dest": str(dest), "module": module, "function": function, "args": list(args)})
        done = subprocess.run(
            [sys.executable, "-c", "from tests.support.releases import binding; binding.child_main()"],
            input=payload,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_env,
            cwd=ROOT,
        )
    for line in done.stdout.splitlines():
        if line.startswith(binding.RESULT_MARK):
            return json.loads(line[len(binding.RESULT_MARK) :])
    raise RuntimeError(
        f"{module}.{function} on megatron-core {version} failed (exit {done.returncode}):\n"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-8000:]}"
    )
