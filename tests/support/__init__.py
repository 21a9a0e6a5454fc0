"""Helpers for the tests (not collected).

Gloo worlds, the differential library and configurations, per-release harnesses.
"""
