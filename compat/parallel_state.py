"""Drop-in replacement for ``megatron.core.parallel_state``, for megatron-core 0.12 … 0.19.

It serves exactly the API of ONE release, :data:`MEGATRON_VERSION` (functions, signatures,
``RankGenerator``, module globals), from one implementation per behaviour; release differences
are data (:mod:`parallel_state_ng.releases.parallel_state`). ``initialize_model_parallel`` runs
the engine's build pipeline (:mod:`parallel_state_ng.groups.pipeline`): only this rank's groups,
checked first, atomic, destroyed without leaks. Beyond MCore: ``get_state``, ``use_state``,
``detach_state``, ``destroy_state``, ``abort_model_parallel``, ``use_collection``,
``sleep_model_parallel``, ``wake_model_parallel``, ``model_parallel_asleep``. See docs/compat.md.
"""

from __future__ import annotations

from parallel_state_ng.layout.order import default_embedding_ranks as _default_embedding_ranks
from parallel_state_ng.layout.order import default_position_embedding_ranks as _default_position_embedding_ranks
from parallel_state_ng.releases import Release as _Release
from parallel_state_ng.releases import parallel_state as _api

from . import _collection, _expert, _getters, _helpers, _init, _legacy, _namespace, _release, _scoping, _sleep
from ._surface import serve as _serve

#: The megatron-core release whose API this module serves (a :class:`~parallel_state_ng.releases.Release`).
MEGATRON_RELEASE: _Release = _release.RELEASE
#: Its version string as found or requested (e.g. ``"0.19.2"``, or ``"0.19"`` from the environment).
MEGATRON_VERSION: str = MEGATRON_RELEASE.version

# The release's module globals, at their import-time values (None, or an empty dict); the
# implementing modules read and write them (and this module's functions) through the facade view.
globals().update({name: (None if init is None else init()) for name, init in _api.globals_of(MEGATRON_RELEASE).items()})
_namespace.facade.attach(globals())

globals().update(
    _serve(
        MEGATRON_RELEASE,
        __name__,
        {
            **{n: f for m in (_getters, _expert, _helpers, _init, _legacy) for n, f in vars(m).items() if callable(f)},
            "destroy_model_parallel": _scoping.destroy_model_parallel,
            "default_embedding_ranks": _default_embedding_ranks,
            "default_position_embedding_ranks": _default_position_embedding_ranks,
        },
    )
)
RankGenerator = _helpers.rank_generator_class(MEGATRON_RELEASE, __name__)

# MCore's private initializers of the buffers (tests and tools call them).
_set_global_memory_buffer = _expert.set_global_memory_buffer
if "_GLOBAL_SYMMETRIC_MEMORY_BUFFER" in globals():
    _set_global_symmetric_memory_buffer = _expert.set_global_symmetric_memory_buffer

# Not MCore API (names chosen not to collide with it): the state object and grid scoping.
get_state = _scoping.get_state
use_state = _scoping.use_state
detach_state = _scoping.detach_state
destroy_state = _scoping.destroy_state
abort_model_parallel = _scoping.abort_model_parallel
use_collection = _collection.use_collection
sleep_model_parallel = _sleep.sleep_model_parallel
wake_model_parallel = _sleep.wake_model_parallel
model_parallel_asleep = _sleep.model_parallel_asleep
