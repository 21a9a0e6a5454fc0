"""The compat facade (compat/) against the installed Megatron-Core.

API, differential, install, scoping, atomicity, bad input.
"""
