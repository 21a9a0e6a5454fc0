"""The command-line tools (parallel_state_ng.tools): layout report, port, upgrade."""
