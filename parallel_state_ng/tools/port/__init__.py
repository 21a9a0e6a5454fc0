"""The ``port`` tool: uses of megatron.core.parallel_state, their switch to compat, the upgrade check."""
