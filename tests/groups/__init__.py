"""Tests of parallel_state_ng.groups: creation, handles, agreement, liveness, sharing, the registry, DeviceMesh."""
