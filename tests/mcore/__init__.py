"""The Megatron part (parallel_state_ng.mcore).

Group kinds, the group plan, MegatronLayout vs the installed MCore, release data.
"""
