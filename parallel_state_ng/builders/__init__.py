"""The new-code API over the build pipeline: grids, collections, topologies and rebuilds.

``HyperCommGrid`` (every release's methods), ``build_megatron_groups``, ``build_topology``,
``rebuild`` after a failure, and running Megatron on a collection (``no_globals``, schedule
set-up). See docs/architecture.md.
"""
