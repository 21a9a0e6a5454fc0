"""Helpers for tests and examples: test worlds and their pytest fixtures
(:mod:`parallel_state_ng.testing.worlds`, :mod:`parallel_state_ng.testing.pytest_plugin`), running
Megatron on CPU (:mod:`parallel_state_ng.testing.megatron_cpu`).
"""
