"""Pure layout math and Megatron's layout as data: no ``torch.distributed``, no side effects.

Named-dim layouts, Megatron's rank lists per group kind, the table of group kinds, one rank's
creation plan, and up-front argument checks. See docs/architecture.md.
"""
