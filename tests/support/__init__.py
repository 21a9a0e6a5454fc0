"""Helpers for the tests (not collected): worlds, releases, the differential harness, the docs' code blocks."""
