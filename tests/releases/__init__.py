"""Per-release checks: each supported megatron-core release in its own subprocess (wheels from tests.support.mcore_releases)."""
