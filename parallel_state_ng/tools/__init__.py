"""Command-line tools of parallel_state_ng (``python -m parallel_state_ng <command>``).

* :mod:`.layout` — ``layout``: the process groups of a configuration (text, JSON, SVG);
* :mod:`.topology` — ``topology SPEC``: a multi-module topology, module by module;
* :mod:`.port` — ``port``: uses of ``megatron.core.parallel_state`` and their switch to
  compat; ``port --upgrade FROM:TO``: what breaks between two megatron-core releases;
* :mod:`.common` — what they share (UsageError, argument checks, report text, SVG head).

All pure layout math or source scanning. The tools: docs/tools.md.
"""
