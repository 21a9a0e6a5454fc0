"""Helpers for tests and examples: running Megatron on CPU (:mod:`parallel_state_ng.testing.megatron_cpu`)."""
