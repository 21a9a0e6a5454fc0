"""The scripts' shared harness: one entry point per folder and what its commands share.

* :mod:`scripts.harness.registry`: the subcommands of every folder (name, module, one-line
  claim) and the dispatcher behind ``python -m scripts.<folder> NAME [ARGS]``;
* :mod:`scripts.harness.header`: the platform header benchmarks print;
* :mod:`scripts.harness.output`: markdown tables and JSON output;
* :mod:`scripts.harness.worlds`: gloo worlds of CPU processes for a script's ranks;
* :mod:`scripts.harness.readme`: scripts/README.md's tables, generated from the registry.
"""
