"""Tests of parallel_state_ng.testing."""
