"""One version for setup.py, ``parallel_state_ng.__version__`` and CHANGELOG.md; the licence in the metadata."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import setuptools

import parallel_state_ng
from parallel_state_ng import _version
from tests.support.paths import ROOT


@pytest.fixture
def setup_kwargs(monkeypatch) -> dict:
    """What setup.py passes to ``setuptools.setup`` (run as a build would, nothing built)."""
    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(Path(ROOT).parent)  # setup.py must not depend on the working directory
    runpy.run_path(str(Path(ROOT, "setup.py")))
    return captured


def test_version_is_stated_once(setup_kwargs):
    assert setup_kwargs["version"] == parallel_state_ng.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", _version.__version__)
    setup_source = Path(ROOT, "setup.py").read_text(encoding="utf-8")
    assert _version.__version__ not in setup_source and "version=read_version()" in setup_source


def test_changelog_names_the_version():
    text = Path(ROOT, "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## (\d+)\.(\d+)\.(\d+)\b", text, flags=re.M)
    assert len(versions) >= 2
    release = _version.__version__.split(".dev")[0]
    assert ".".join(versions[0]) == release, "the newest CHANGELOG heading must be the package's version"
    numbers = [tuple(map(int, v)) for v in versions]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)


def test_licence_is_declared(setup_kwargs):
    licence = Path(ROOT, "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("BSD 3-Clause License\n")
    assert "Copyright (c) 2026, the parallel_state_ng authors" in licence
    assert "Neither the name of the copyright holder nor the names of its" in licence
    assert setup_kwargs["license"] == "BSD-3-Clause"
    assert setup_kwargs["license_files"] == ["LICENSE"]
    assert not [c for c in setup_kwargs["classifiers"] if c.startswith("License ::")], "SPDX licence only"


def test_runtime_needs_torch_only_and_the_docs_tools_are_pinned(setup_kwargs):
    assert setup_kwargs["install_requires"] == ["torch>=2.6"]
    docs = setup_kwargs["extras_require"]["docs"]
    assert any(r.startswith("mkdocs==") for r in docs) and any(r.startswith("mkdocstrings") for r in docs)
    assert all(re.fullmatch(r"[\w.\[\]-]+==[\w.]+", r) for r in docs), docs
