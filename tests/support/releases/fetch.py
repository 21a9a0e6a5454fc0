"""Fetching megatron-core release wheels: each release's wheel downloaded and unzipped once.

Needs only the standard library and pip (no torch): CI runs ``python -m
tests.support.releases.fetch`` in the background from its start, so the tests find every release
in place. :mod:`tests.support.releases.wheels` re-exports these names and runs code against them.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

# Release series -> the patch release the tests use (within a series the files compat mirrors
# are byte-identical), oldest first. 0.12 and 0.13 are the encoder/decoder era
# (:data:`LEGACY_RELEASES`, also part of :data:`RELEASES`).
LEGACY_RELEASES: dict[str, str] = {"0.12": "0.12.3", "0.13": "0.13.1"}
RELEASES: dict[str, str] = {
    **LEGACY_RELEASES,
    "0.14": "0.14.0",
    "0.15": "0.15.3",
    "0.16": "0.16.1",
    "0.17": "0.17.1",
    "0.18": "0.18.2",
    "0.19": "0.19.2",
}
# Series whose wheels are cp312-only (0.12-0.16 install on Python 3.11 normally).
_CP312_ONLY = {"0.17", "0.18", "0.19"}


def cache_root() -> Path:
    """Where unzipped releases live (``$PSNG_RELEASE_CACHE`` or the user cache)."""
    env = os.environ.get("PSNG_RELEASE_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "parallel_state_ng" / "megatron-core"
    base.mkdir(parents=True, exist_ok=True)
    return base


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download(version: str, into: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--disable-pip-version-check",
        f"megatron-core=={version}",
        "-d",
        str(into),
    ]
    if _series(version) in _CP312_ONLY:
        cmd[4:4] = ["--python-version", "3.12", "--only-binary=:all:"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(str(into / f"megatron_core-{version}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download megatron-core=={version}: {done.stderr.strip()[-2000:]}")
    return Path(wheels[0])


def release_dir(version: str) -> Path:
    """The unzipped wheel of megatron-core ``version`` (downloaded on first use).

    ``pip download --no-deps`` (releases 0.17+ publish cp312-only wheels, fetched with
    ``--python-version 3.12 --only-binary=:all:``), unzipped into :func:`cache_root`. Concurrent
    test workers wait on a file lock; a finished release is a directory never modified again.
    """
    root = cache_root()
    dest = root / version
    if (dest / "megatron" / "core" / "parallel_state.py").is_file():
        return dest
    with _locked(root / f".{version}.lock"):
        if (dest / "megatron" / "core" / "parallel_state.py").is_file():
            return dest
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{version}-") as tmp:
            wheel = _download(version, Path(tmp))
            unpacked = Path(tmp) / "unpacked"
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(unpacked)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(unpacked, dest)
    return dest


def fetch_all() -> list[Path]:
    """Download and unzip every release of :data:`RELEASES` not yet in the cache, side by side."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(RELEASES)) as pool:
        return list(pool.map(release_dir, RELEASES.values()))


if __name__ == "__main__":
    for found in fetch_all():
        print(found)
