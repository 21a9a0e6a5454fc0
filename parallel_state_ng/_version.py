"""The package version, stated once: ``setup.py`` and :data:`parallel_state_ng.__version__` read it.

CHANGELOG.md's newest heading names the same release (``tests/docs/test_package_metadata.py``).
"""

__version__ = "0.6.0.dev0"
