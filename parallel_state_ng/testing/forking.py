"""Starting worker processes without paying torch's import each time: a fork server that has it.

A fresh interpreter spends about 1.5 s of CPU importing torch. :func:`worker_context` gives the
``forkserver`` multiprocessing context whose server has imported torch once, so each worker is
forked from it: still a new process with no megatron imported, ``sys.path`` and the main module
prepared as ``spawn`` prepares them, and the environment it is given. Where megatron-core can be
imported, the server also imports the parts of torch that megatron's own import pulls in
(:data:`MEGATRON_TORCH_MODULES`), so a worker that imports megatron pays about 0.5 s of CPU for
it instead of about 3.5 s. Used by :class:`parallel_state_ng.testing.worlds.GlooWorld` and by
the project's own test harnesses.

``$PSNG_RELEASE_FORK=0`` (:data:`DISABLE_VAR`) turns forking off (every worker is spawned), and a
server serves only callers whose environment matches the one it started with (:func:`env_key`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import multiprocessing as mp
import multiprocessing.forkserver
import os
from collections.abc import Callable, Iterator
from typing import Any

#: The environment variable that turns forking off when it is ``"0"``: every worker a fresh interpreter.
DISABLE_VAR = "PSNG_RELEASE_FORK"
#: What the fork server imports before it forks anything.
PRELOAD = ["torch", "torch.distributed"]
#: The torch modules that ``import megatron.core`` adds to those (the same in megatron-core 0.12
#: to 0.19 on torch 2.13): ``torch.compile``'s stack, which its fused kernels' decorators load,
#: DTensor, distributed checkpointing, FSDP, and the fake backend the simulated worlds use.
#: A name that a torch release lacks is skipped.
MEGATRON_TORCH_MODULES = [
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.onnx",
    "torch.testing._internal.distributed.fake_pg",
]
_SERVER_ENV: list[dict[str, str]] = []  # the environment (key) the fork server was started with


def env_key(env: dict[str, str]) -> dict[str, str]:
    """What of ``env`` torch could read at import: all but ``PSNG_*`` (read only by this project)
    and ``PYTEST_CURRENT_TEST``; a server started with another key cannot serve ``env``.
    """
    return {k: v for k, v in env.items() if not k.startswith("PSNG_") and k != "PYTEST_CURRENT_TEST"}


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is exactly ``env`` inside the block, and as it was after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def worker_context(env: dict[str, str], *, for_megatron: bool = True) -> Any:
    """The ``forkserver`` context, its server running with ``env``; ``spawn`` where it cannot.

    The server (started here, or restarted after it died) imports :data:`PRELOAD` with ``env``
    as its environment, and :data:`MEGATRON_TORCH_MODULES` too when ``for_megatron`` is true and
    megatron-core can be imported (about 3 s of CPU, once; pass ``False`` when no worker imports
    megatron). The call that starts the server decides what it imports. A caller whose
    environment differs in anything torch could read at import (:func:`env_key`) from the one
    the running server was started with gets ``spawn``, as does every caller while
    ``$PSNG_RELEASE_FORK`` is ``0``. One difference from ``spawn``: forked workers share the
    server's string-hash seed.
    """
    if os.environ.get(DISABLE_VAR) == "0" or (_SERVER_ENV and _SERVER_ENV[0] != env_key(env)):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    with _environ(env):
        ctx.set_forkserver_preload(server_preload(for_megatron))
        multiprocessing.forkserver.ensure_running()
    if not _SERVER_ENV:
        atexit.register(_stop_server)
    _SERVER_ENV[:] = [env_key(env)]
    return ctx


def server_preload(for_megatron: bool = True) -> list[str]:
    """What a fork server imports: :data:`PRELOAD`, and :data:`MEGATRON_TORCH_MODULES` when
    ``for_megatron`` is true and megatron-core can be imported here.
    """
    return PRELOAD + (MEGATRON_TORCH_MODULES if for_megatron and _megatron_found() else [])


def _megatron_found() -> bool:
    """Whether ``megatron.core`` can be imported here (found on ``sys.path``; not imported)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def run_in_environ(env: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """A process target: make ``os.environ`` exactly ``env``, then return ``target(*args)``.

    A forked worker starts with the fork server's environment; passing the caller's own (as
    ``spawn`` would) through this keeps what the worker sees the same in both start methods.
    """
    os.environ.clear()
    os.environ.update(env)
    return target(*args)


def _stop_server() -> None:
    """Stop and reap the fork server at exit (its workers' CPU time then counts for this process)."""
    with contextlib.suppress(Exception):
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
