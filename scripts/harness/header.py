"""The platform header benchmarks print: torch, megatron-core (where importable), Python, machine, CPUs.

:func:`platform_facts` returns the figures as a dict (for JSON output); :func:`platform_header`
as one line. torch and megatron-core are imported when called, never at import of this module
(a benchmark that times imports must not pay for them before it starts).
"""

from __future__ import annotations

import os
import platform
from typing import Any


def megatron_core_version() -> str | None:
    """megatron-core's version, or None where it cannot be imported."""
    try:
        import megatron.core
    except Exception:  # absent or broken: the header says so instead of failing the benchmark
        return None
    return str(getattr(megatron.core, "__version__", "?"))


def platform_facts() -> dict[str, Any]:
    """``torch``, ``megatron_core`` (None where not importable), ``python`` (implementation and
    version), ``machine`` (processor or architecture) and ``cpus`` (``os.cpu_count()``).
    """
    import torch

    return {
        "torch": torch.__version__,
        "megatron_core": megatron_core_version(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def platform_header(facts: dict[str, Any] | None = None) -> str:
    """One line: ``torch 2.13.0, megatron-core 0.16.1, CPython 3.11.7, x86_64, 16 CPUs``."""
    facts = platform_facts() if facts is None else facts
    megatron = facts["megatron_core"]
    return (
        f"torch {facts['torch']}, megatron-core {megatron if megatron is not None else 'not importable'}, "
        f"{facts['python']}, {facts['machine']}, {facts['cpus']} CPUs"
    )
