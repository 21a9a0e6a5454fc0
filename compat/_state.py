"""The one state object behind ``compat.parallel_state``.

compat's state is the engine's :class:`~parallel_state_ng.groups.megatron_groups.ModelParallelGroups`:
one rank's groups for a :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`, created by
executing the rank's group plan (:func:`~parallel_state_ng.groups.megatron_groups.create_model_groups`:
only the rank's own groups, atomic). compat adds the module globals on top
(:mod:`compat._publish`); :func:`parallel_state_ng.builders.collection.build_megatron_groups`
builds the same object with no global at all.
"""

from __future__ import annotations

from parallel_state_ng.groups.creation import destroy_groups
from parallel_state_ng.groups.megatron_groups import ModelParallelGroups as ParallelState
from parallel_state_ng.groups.megatron_groups import create_model_groups as build_state
from parallel_state_ng.groups.megatron_groups import destroy_model_groups as destroy_state

__all__ = ["ParallelState", "build_state", "destroy_state", "destroy_groups"]
