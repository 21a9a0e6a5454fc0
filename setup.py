"""Packaging for parallel_state_ng (engine) and compat (Megatron-Core parallel_state facade)."""

from setuptools import find_packages, setup

TEST_REQUIRES = [
    "pytest>=7",
    "pytest-xdist>=3",
    "megatron-core==0.16.1",
    "einops",  # megatron's HyperCommGrid and hierarchical groups need it
    "pyyaml",  # nccl_communicator_config_path
    "numpy",
    # megatron-core 0.18+ import it from megatron/core/__init__.py: the training tests on those
    # releases' wheels (tests/integration/test_train_releases.py); no dependencies, CPU torch stays
    "triton",
]
#: Pinned so that CI's lint and type check do not change under the code (see .ci/run).
LINT_REQUIRES = ["ruff==0.17.6", "mypy==2.4.1"]

setup(
    name="parallel_state_ng",
    version="0.1.0",
    description=(
        "Named-dimension process-group grids with Megatron-Core's exact rank layout, and a "
        "drop-in replacement for megatron.core.parallel_state"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["parallel_state_ng", "parallel_state_ng.*", "compat"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    extras_require={"megatron": ["megatron-core", "einops"], "test": TEST_REQUIRES, "lint": LINT_REQUIRES},
    package_data={"parallel_state_ng": ["py.typed"], "compat": ["py.typed"]},
    entry_points={"console_scripts": ["parallel-state-ng=parallel_state_ng.__main__:main"]},
)
