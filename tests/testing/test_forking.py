"""The fork server of ``parallel_state_ng.testing.forking``: what it imports before forking workers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from parallel_state_ng.testing import forking
from tests.support.paths import ROOT


def test_server_preload_adds_megatrons_torch_modules_only_when_asked_and_found(monkeypatch):
    monkeypatch.setattr(forking, "_megatron_found", lambda: True)
    assert forking.server_preload() == forking.PRELOAD + forking.MEGATRON_TORCH_MODULES
    assert forking.server_preload(for_megatron=False) == forking.PRELOAD
    monkeypatch.setattr(forking, "_megatron_found", lambda: False)
    assert forking.server_preload() == forking.PRELOAD


def test_megatron_found_does_not_import_it():
    before = {m for m in sys.modules if m.split(".")[0] == "megatron"}
    found = forking._megatron_found()
    assert found == (importlib.util.find_spec("megatron") is not None)
    assert {m for m in sys.modules if m.split(".")[0] == "megatron"} - before <= {"megatron"}


def report_modules(queue: Any) -> None:
    """A worker's target: which of the modules the server may import this process starts with."""
    names = ["torch", "torch.distributed", *forking.MEGATRON_TORCH_MODULES]
    queue.put(
        {
            "loaded": [n for n in names if n in sys.modules],
            "megatron": sorted(m for m in sys.modules if m.startswith("megatron.")),
        }
    )


_WORKER = """
import json, os, sys
from parallel_state_ng.testing.forking import worker_context
from tests.testing.test_forking import report_modules
ctx = worker_context(dict(os.environ), for_megatron=sys.argv[1] == "1")
queue = ctx.SimpleQueue()
process = ctx.Process(target=report_modules, args=(queue,))
process.start()
result = queue.get()
process.join()
print(json.dumps({"method": ctx.get_start_method(), **result}))
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_forked_workers_start_with_megatrons_torch_modules_and_without_megatron():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop(forking.DISABLE_VAR, None)
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, "1"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["method"] == "forkserver"
    assert result["megatron"] == []  # the worker still chooses when (and which) megatron it imports
    expected = ["torch", "torch.distributed", *forking.MEGATRON_TORCH_MODULES]
    missing = [n for n in expected if n not in result["loaded"] and importlib.util.find_spec(n) is not None]
    assert missing == []
