"""Helpers for the tests (not collected): gloo worlds, the differential library and configurations, per-release harnesses."""
