"""Worlds to run code in: simulated (fake backend, one process) and real (gloo, many processes)."""
