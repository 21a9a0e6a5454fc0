"""The per-rank init benchmark (``python -m scripts.bench init``): one simulated rank's cost of
``initialize_model_parallel``, MCore vs compat vs the floor.

* :mod:`scripts.bench.init.cost`: the benchmark (its driver and the worker processes it spawns);
* :mod:`scripts.bench.init.probes`: what it measures with: memory, ``new_group`` calls, the
  groups every getter hands out.
"""
