"""Packaging for parallel_state_ng (engine) and compat (Megatron-Core parallel_state facade)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def read_version() -> str:
    """The version stated once, in parallel_state_ng/_version.py (setup.py must not import the package)."""
    text = (HERE / "parallel_state_ng" / "_version.py").read_text(encoding="utf-8")
    found = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.M)
    if found is None:
        raise RuntimeError('parallel_state_ng/_version.py has no line __version__ = "..."')
    return found.group(1)


TEST_REQUIRES = [
    "pytest>=7",
    "pytest-xdist>=3",
    "megatron-core==0.16.1",
    "einops",  # megatron's HyperCommGrid and hierarchical groups need it
    "pyyaml",  # nccl_communicator_config_path
    "numpy",
    "hypothesis",  # tests/fuzz: the hostile-input harness
    # megatron-core 0.18+ import it from megatron/core/__init__.py: the training tests on those
    # releases' wheels (tests/integration/test_train_releases.py); no dependencies, CPU torch stays
    "triton",
]
#: Pinned so that CI's lint and type check do not change under the code (see .ci/run).
LINT_REQUIRES = ["ruff==0.17.6", "mypy==2.4.1"]
#: The docs site (mkdocs.yml), pinned so that the strict build does not change under the pages (see
#: .ci/run, which installs them into .venv-docs and builds the site beside the tests).
DOCS_REQUIRES = [
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings[python]==1.0.8",
    "mkdocstrings-python==2.0.11",
    "griffelib==2.4.1",
    "mkdocs-autorefs==1.4.5",
    "pymdown-extensions==13.1.2",
]

setup(
    name="parallel_state_ng",
    version=read_version(),
    description=(
        "Named-dimension process-group grids with Megatron-Core's exact rank layout, and a "
        "drop-in replacement for megatron.core.parallel_state"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    # The licence is the SPDX expression above; no "License ::" classifier: setuptools deprecates
    # them next to an SPDX licence (a warning today, an error in later releases).
    classifiers=["Programming Language :: Python :: 3"],
    packages=find_packages(include=["parallel_state_ng", "parallel_state_ng.*", "compat"]),
    python_requires=">=3.10",
    # torch 2.6: megatron-core 0.15+'s own floor (docs/results/torch.md: 2.5.1 passes with both installed
    # --no-deps, 2.4.1 fails; what differs by release is in groups/torch_support.py).
    install_requires=["torch>=2.6"],
    extras_require={
        "megatron": ["megatron-core", "einops"],
        "test": TEST_REQUIRES,
        "lint": LINT_REQUIRES,
        "docs": DOCS_REQUIRES,
    },
    package_data={"parallel_state_ng": ["py.typed"], "compat": ["py.typed"]},
    entry_points={
        "console_scripts": [
            "parallel-state-ng=parallel_state_ng.__main__:main",
            # python -m compat.run: run an unchanged Megatron program on compat (docs/compat.md)
            "compat-run=compat.run:main",
        ]
    },
)
