"""End to end: scripts/demo.py, Megatron-Core itself on compat, GPT training runs."""
