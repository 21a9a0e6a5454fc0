"""What Megatron-Core builds, as data and pure math over the generic core.

* :mod:`.releases` — which release is served, and every per-release fact as data.
* :mod:`.kinds` — Megatron's order strings and the arithmetic its group kinds share.
* :mod:`.plan` — the group plan: every group kind stated once, and a rank's creation steps.
* :mod:`.layout` / :mod:`.encoder_layout` — the rank lists of each kind, in closed form.
* :mod:`.groups` / :mod:`.collection` — one layout's groups on this rank; one module's groups
  with no global, as a ``ProcessGroupCollection``.
* :mod:`.scope` — scopes in which Megatron's globals refuse to answer (``no_globals``).
* :mod:`.megatron_setup` — the rest of the pg_collection path's set-up (memory buffer, schedule).
* :mod:`.grid_releases` — ``HyperCommGrid`` classes with one release's exact methods.
"""
