"""Megatron-Core compatibility layer of parallel_state_ng.

* ``compat.parallel_state`` — the whole global API of ``megatron.core.parallel_state``
  (megatron-core 0.16.1) on top of the parallel_state_ng engine.
* :func:`install` / :func:`uninstall` — make Megatron itself use it.

Importing this package imports neither megatron nor torch.
"""

from __future__ import annotations

__all__ = ["install", "uninstall", "is_installed"]


def install() -> None:
    """Make ``megatron.core.parallel_state`` resolve to ``compat.parallel_state``.

    Works whether megatron was imported before or after: ``sys.modules`` and the
    ``megatron.core.parallel_state`` / ``megatron.core.mpu`` attributes point at compat, and
    names already bound in loaded modules (``from megatron.core.parallel_state import
    get_tensor_model_parallel_rank`` in ``tensor_parallel/layers.py`` and many others, or
    ``from megatron.core import parallel_state as mpu``) are rebound to compat's objects.
    Calling it twice is harmless. :func:`uninstall` undoes everything.
    """
    from ._install import install as _install

    _install()


def uninstall() -> None:
    """Undo :func:`install`: every patched name gets back Megatron's own object."""
    from ._install import uninstall as _uninstall

    _uninstall()


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    import sys

    mod = sys.modules.get("compat._install")
    return bool(mod and mod.is_installed())
