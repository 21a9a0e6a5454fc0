"""Benchmarks and measurements: init time and memory, world init, agreement, collections, layouts, failures."""
