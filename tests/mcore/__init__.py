"""The Megatron part (parallel_state_ng.mcore): group kinds, the group plan, MegatronLayout vs the installed MCore, release data."""
