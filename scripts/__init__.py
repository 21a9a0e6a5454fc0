"""Benchmarks, examples and measurements; each runs as ``python -m scripts.<folder>.<name>`` from the root."""
