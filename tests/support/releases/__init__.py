"""Megatron-Core releases from their wheels: fetched, bound to a process, and checked there."""
