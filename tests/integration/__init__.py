"""End to end: scripts/examples/demo.py, Megatron-Core itself on compat, GPT training runs."""
