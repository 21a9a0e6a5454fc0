"""Inside a process bound to one megatron-core release: bind it, run the call, report the result.

:func:`activate` puts a release first on ``sys.path`` and registers ``megatron`` and
``megatron.core`` as bare packages, so that release's ``megatron.core.parallel_state`` imports
without running ``megatron/core/__init__.py`` (0.18+ imports triton there);
``importlib.metadata.version("megatron-core")`` then reports the release, which is how compat
picks the API it serves. A call's JSON result is the stdout line starting with
:data:`RESULT_MARK` (:func:`tests.support.releases.wheels.run_in_release` reads it).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types

RESULT_MARK = "@@PSNG-RESULT@@"


def activate(dest: str | os.PathLike) -> None:
    """Make ``megatron.core`` of the release unzipped at ``dest`` importable in this process.

    Must run before anything imports megatron. ``megatron`` and ``megatron.core`` become bare
    packages (their ``__init__`` does not run); submodules load from ``dest``.
    """
    dest = str(dest)
    already = [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]
    if already:
        raise RuntimeError(f"megatron is already imported in this process: {already[:3]}")
    sys.path.insert(0, dest)
    importlib.invalidate_caches()
    for name, sub in (("megatron", "megatron"), ("megatron.core", "megatron/core")):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(dest, sub)]
        package.__package__ = name
        sys.modules[name] = package
    sys.modules["megatron"].core = sys.modules["megatron.core"]


def write_result(result: object) -> None:
    """Report a call's result (JSON) on stdout, as the parent expects it."""
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def child_main() -> None:
    """A fresh interpreter's call: ``{dest, module, function, args}`` (JSON) on stdin."""
    payload = json.loads(sys.stdin.read())
    activate(payload["dest"])
    fn = getattr(importlib.import_module(payload["module"]), payload["function"])
    write_result(fn(*payload["args"]))
