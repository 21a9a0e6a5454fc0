"""Tests of the docs (every code block of README.md and docs/**/*.md) and of the package metadata."""
