"""Which Megatron-Core release to mirror, and what differs between releases.

Every difference between releases is data in this package, keyed by release series (``"0.19"``);
code elsewhere asks :class:`Release` questions and never compares version strings itself.
:func:`select_release` picks the release (``$PSNG_MEGATRON_VERSION``, else the installed
megatron-core, else the newest). See docs/releases.md ("Which release is served").
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import warnings
from dataclasses import dataclass

__all__ = [
    "SUPPORTED_SERIES",
    "KNOWN_SERIES",
    "ENV_VAR",
    "Release",
    "UnsupportedReleaseError",
    "installed_megatron_version",
    "parse_release",
    "as_release",
    "known_release",
    "select_release",
    "current_release",
]

# Supported release series, oldest first. A series is one entry whatever its patch releases:
# within a series the files mirrored here are identical. 0.12 and 0.13 are the encoder/decoder
# era (encoder sizes, pipeline split rank); 0.14 on is the modern API.
SUPPORTED_SERIES: tuple[str, ...] = ("0.12", "0.13", "0.14", "0.15", "0.16", "0.17", "0.18", "0.19")
# Release series the per-release data knows (the upgrade check, ``port --upgrade``): every
# supported one.
KNOWN_SERIES: tuple[str, ...] = SUPPORTED_SERIES
ENV_VAR = "PSNG_MEGATRON_VERSION"

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


class UnsupportedReleaseError(ValueError):
    """The requested or installed megatron-core release is older than every supported one."""


@dataclass(frozen=True)
class Release:
    """One Megatron-Core release series being mirrored.

    ``version`` is the version string as found (``"0.19.2"``, ``"0.16.0rc0"``) or requested;
    ``series`` is its ``major.minor`` (the key of every per-release fact).
    """

    major: int
    minor: int
    version: str

    @property
    def series(self) -> str:
        """``"major.minor"``, e.g. ``"0.19"``."""
        return f"{self.major}.{self.minor}"

    @property
    def key(self) -> tuple[int, int]:
        """Sortable ``(major, minor)``."""
        return (self.major, self.minor)

    def at_least(self, series: str) -> bool:
        """Whether this release is ``series`` (``"0.17"``) or newer."""
        return self.key >= _series_key(series)

    def before(self, series: str) -> bool:
        """Whether this release is older than ``series``."""
        return self.key < _series_key(series)

    def after(self, series: str) -> bool:
        """Whether this release is newer than ``series``."""
        return self.key > _series_key(series)

    def __str__(self) -> str:
        return self.version


def _series_key(series: str) -> tuple[int, int]:
    match = _VERSION_RE.match(series)
    if match is None:
        raise ValueError(f"not a release series: {series!r} (expected e.g. '0.19')")
    return (int(match.group(1)), int(match.group(2)))


def parse_release(version: str) -> Release:
    """Parse ``"0.19"``, ``"0.19.2"``, ``"0.16.0rc0"``, ... into a :class:`Release`.

    Raises:
        ValueError: ``version`` does not start with ``major.minor``.
    """
    match = _VERSION_RE.match(str(version))
    if match is None:
        raise ValueError(f"cannot read a megatron-core release from {version!r} (expected e.g. '0.19' or '0.19.2')")
    return Release(int(match.group(1)), int(match.group(2)), str(version).strip())


def as_release(release: str | Release | None = None) -> Release:
    """``release`` as a :class:`Release`: a :class:`Release` as it is, a version string parsed,
    ``None`` the release being served (:func:`current_release`).

    Raises:
        ValueError: a string that does not start with ``major.minor``.
    """
    if release is None:
        return current_release()
    return release if isinstance(release, Release) else parse_release(release)


def known_release(release: str | Release | None = None) -> Release:
    """:func:`as_release`, refusing a series the per-release data does not cover.

    Raises:
        ValueError: not a version string, or not one of :data:`KNOWN_SERIES` (the message names them).
    """
    found = as_release(release)
    if found.series not in KNOWN_SERIES:
        raise ValueError(f"release {release!s} is not a known series ({', '.join(KNOWN_SERIES)})")
    return found


def installed_megatron_version() -> str | None:
    """The installed ``megatron-core`` distribution's version, or ``None`` (megatron not imported)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _supported(release: Release, source: str) -> Release:
    oldest, newest = parse_release(SUPPORTED_SERIES[0]), parse_release(SUPPORTED_SERIES[-1])
    if release.key < oldest.key:
        raise UnsupportedReleaseError(
            f"megatron-core {release.version} ({source}) is not supported: parallel_state_ng mirrors "
            f"releases {SUPPORTED_SERIES[0]} to {SUPPORTED_SERIES[-1]}; set {ENV_VAR} to one of "
            f"{', '.join(SUPPORTED_SERIES)} or install a supported megatron-core"
        )
    if release.key > newest.key:
        warnings.warn(
            f"megatron-core {release.version} ({source}) is newer than the newest release parallel_state_ng "
            f"knows ({SUPPORTED_SERIES[-1]}); serving the {SUPPORTED_SERIES[-1]} API",
            stacklevel=3,
        )
        return Release(newest.major, newest.minor, release.version)
    if release.series not in SUPPORTED_SERIES:
        raise UnsupportedReleaseError(
            f"megatron-core {release.version} ({source}) is not a known release series; supported: "
            f"{', '.join(SUPPORTED_SERIES)}"
        )
    return release


def select_release(requested: str | None = None) -> Release:
    """The release to mirror: ``requested``, else ``$PSNG_MEGATRON_VERSION``, else installed, else newest.

    Raises:
        UnsupportedReleaseError: the chosen release is older than the oldest supported one.
        ValueError: ``requested`` / the environment variable is not a version string.
    """
    if requested is not None:
        return _supported(parse_release(requested), "requested")
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            parsed = parse_release(env)
        except ValueError as err:
            raise ValueError(f"environment variable {ENV_VAR}: {err}") from None
        return _supported(parsed, f"from ${ENV_VAR}")
    installed = installed_megatron_version()
    if installed is not None:
        return _supported(parse_release(installed), "installed")
    newest = parse_release(SUPPORTED_SERIES[-1])
    return newest


@functools.cache
def _cached_default() -> Release:
    return select_release()


def current_release() -> Release:
    """:func:`select_release` with no argument, computed once per process."""
    return _cached_default()
