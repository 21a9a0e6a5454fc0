"""``parallel-state-ng diagnose DUMP_DIR``: a hang named from flight-recorder dumps and the layout."""
