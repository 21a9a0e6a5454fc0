"""Fork server for the release-bound calls of :func:`tests.support.releases.wheels.run_in_release`.

A new interpreter per call pays Python, torch (~1.5 s CPU) and the release's ``parallel_state``
(~0.9 s) before any check runs. Here one server per pytest(-xdist) worker imports torch once;
per release it forks a *zygote* bound to that release (:func:`tests.support.releases.binding.activate`)
that imports its ``parallel_state``; each call is forked from that zygote: a process of its own
(modules, ``torch.distributed`` state, environment), nothing it does reaches the next call.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, BinaryIO

from parallel_state_ng.testing.forking import DISABLE_VAR, MEGATRON_TORCH_MODULES, PRELOAD, env_key
from tests.support.paths import ROOT
from tests.support.releases import binding

# --------------------------------------------------------------------------- server side
# Protocol, JSON lines: the parent sends ``{dest, module, function, args, env, cwd, out, err}``
# to the server, which passes it to the release's zygote; the zygote forks the call (stdout and
# stderr to the files ``out`` and ``err``, the result line as in a fresh child), waits for it and
# answers ``{"status": exit code}``.


def _send(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _run_call(request: dict) -> None:
    """Body of one forked call: its output files, environment and directory, then the function."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        try:
            fn = getattr(importlib.import_module(request["module"]), request["function"])
            result = fn(*request["args"])
            binding.write_result(result)
            code = 0
        except BaseException:  # reported like a fresh child's uncaught exception
            traceback.print_exc()
        with contextlib.suppress(Exception):
            import atexit as _atexit

            _atexit._run_exitfuncs()  # what a fresh interpreter runs at exit
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _zygote(dest: str, requests: BinaryIO, answers: int) -> None:
    """Bound to the release at ``dest``: fork one process per request, answer its exit status."""
    binding.activate(dest)
    with contextlib.suppress(Exception):  # a call that imports it reports the error itself
        importlib.import_module("megatron.core.parallel_state")
    gc.collect()
    gc.freeze()  # keep the shared pages shared in the forked calls
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            os.close(answers)
            _run_call(request)
        _, status = os.waitpid(pid, 0)
        _send(answers, {"status": os.waitstatus_to_exitcode(status)})
    os._exit(0)


def serve() -> None:
    """Server main loop (in its own process): import torch once, one zygote per release."""
    for name in PRELOAD + MEGATRON_TORCH_MODULES:  # what every release's import of megatron needs
        with contextlib.suppress(ImportError):
            importlib.import_module(name)

    zygotes: dict[str, tuple[int, int, BinaryIO]] = {}  # dest -> (pid, request fd, answer stream)

    def start(dest: str) -> tuple[int, int, BinaryIO]:
        from_parent, to_zygote = os.pipe()
        from_zygote, to_parent = os.pipe()
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)  # stdout is the server's channel: not the zygote's
            os.close(null)
            for _, fd, stream in zygotes.values():  # other zygotes' pipes: they must see EOF
                os.close(fd)
                stream.close()
            os.close(to_zygote)
            os.close(from_zygote)
            try:
                _zygote(dest, os.fdopen(from_parent, "rb"), to_parent)
            finally:
                os._exit(1)
        os.close(from_parent)
        os.close(to_parent)
        return pid, to_zygote, os.fdopen(from_zygote, "rb")

    for line in sys.stdin.buffer:
        request = json.loads(line)
        dest = request["dest"]
        if dest not in zygotes:
            zygotes[dest] = start(dest)
        pid, to_zygote, answers = zygotes[dest]
        try:
            os.write(to_zygote, line)
            answer = answers.readline()
        except OSError:
            answer = b""
        if not answer:  # the zygote died: report it, start a new one next time
            del zygotes[dest]
            os.close(to_zygote)
            answers.close()
            os.waitpid(pid, 0)
            _send(1, {"status": None, "error": f"the zygote of {dest} exited"})
            continue
        os.write(1, answer)
    for pid, to_zygote, answers in zygotes.values():
        os.close(to_zygote)
        answers.close()
        os.waitpid(pid, 0)


# --------------------------------------------------------------------------- parent side


class ForkServer:
    """A running server process (see the module docstring)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.key = env_key(env)
        self.tmp = tempfile.mkdtemp(prefix="psng-forkserver-")
        self.log = open(os.path.join(self.tmp, "server.log"), "wb")  # noqa: SIM115 (closed in close())
        self.calls = itertools.count()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.support.releases import forkserver as s; s.serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=ROOT,
            start_new_session=True,  # its zygotes and calls share its process group: killed together
        )

    def call(self, request: dict, timeout: float) -> subprocess.CompletedProcess:
        """Run one request; the call's exit status and output, as ``subprocess.run`` gives them."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        n = next(self.calls)
        out, err = (os.path.join(self.tmp, f"call{n}.{name}") for name in ("out", "err"))
        self.proc.stdin.write((json.dumps({**request, "out": out, "err": err}) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close(kill=True)
            raise subprocess.TimeoutExpired(f"{request['module']}.{request['function']} (fork server)", timeout)
        line = self.proc.stdout.readline()
        answer = json.loads(line) if line else {"status": None, "error": "the fork server exited"}
        texts = []
        for path in (out, err):
            try:
                texts.append(Path(path).read_text(errors="replace"))
                os.unlink(path)
            except FileNotFoundError:
                texts.append("")
        if answer["status"] is None:
            if not line:
                self.close()
            texts[1] += f"\n[{answer['error']}; server log: {self.log_tail()}]"
        status = -1 if answer["status"] is None else answer["status"]
        return subprocess.CompletedProcess(request["module"], status, texts[0], texts[1])

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return Path(self.tmp, "server.log").read_text(errors="replace")[-2000:]
        return ""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, kill: bool = False) -> None:
        """Stop the server, its zygotes and any running call (at once with ``kill``)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if not kill:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # zygotes and calls left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_SERVER: list[ForkServer] = []  # the running server of this process (none or one)
_LOCK = threading.Lock()


def _close_all() -> None:
    while _SERVER:
        _SERVER.pop().close()


atexit.register(_close_all)


def call(
    dest: str, module: str, function: str, args: list[Any], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess | None:
    """Run ``module.function(*args)`` in a call forked from the zygote of the release at ``dest``.

    ``env`` is the call's whole environment. Returns None where the caller must start a fresh
    interpreter instead: ``$PSNG_RELEASE_FORK`` is ``0``, or another thread of this process is
    using the server. The server lives as long as the test process (closed at exit) and is
    started with the caller's environment; a call whose environment differs in anything torch
    could read at import (any variable apart from ``PSNG_*`` ones, which only this project
    reads, and ``PYTEST_CURRENT_TEST``) gets a new server started with it.
    """
    if os.environ.get(DISABLE_VAR) == "0" or not _LOCK.acquire(blocking=False):
        return None
    try:
        if _SERVER and (not _SERVER[0].alive or _SERVER[0].key != env_key(env)):
            _SERVER.pop().close()
        if not _SERVER:
            _SERVER.append(ForkServer(env))
        request = {"dest": dest, "module": module, "function": function, "args": args, "env": env}
        try:
            return _SERVER[0].call({**request, "cwd": ROOT}, timeout)
        finally:
            if not _SERVER[0].alive:
                _SERVER.pop().close()
    finally:
        _LOCK.release()
