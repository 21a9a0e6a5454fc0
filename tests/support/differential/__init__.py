"""The differential harness: compat against Megatron-Core's parallel_state, snapshot for snapshot."""
