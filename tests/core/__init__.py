"""The generic engine (parallel_state_ng.core): layout, grid, naming, handles, mesh, sharing, agreement, objects."""
