"""Per-release checks.

Each supported megatron-core release in its own subprocess (wheels from tests.support.releases.wheels).
"""
