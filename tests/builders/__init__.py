"""Tests of parallel_state_ng.builders."""
