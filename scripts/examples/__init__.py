"""Examples: the demo, Megatron GPT training on CPU processes (core loop, pretrain loop, restart), two modules."""
