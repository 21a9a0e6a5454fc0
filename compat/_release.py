"""The megatron-core release compat serves, decided once per process.

Every compat module that needs the release imports it from here (never from the facade
module), so nothing depends on the order in which compat's modules are imported. The choice
itself is :func:`parallel_state_ng.releases.current_release` (``$PSNG_MEGATRON_VERSION``,
else the installed megatron-core, else the newest supported release).
"""

from __future__ import annotations

from parallel_state_ng.releases import Release, current_release
from parallel_state_ng.releases.facts import ReleaseFacts, release_facts

__all__ = ["RELEASE", "VERSION", "FACTS"]

#: The release served.
RELEASE: Release = current_release()
#: Its version string as found or requested (``"0.19.2"``, or ``"0.19"`` from the environment).
VERSION: str = RELEASE.version
#: What that release does, by attribute (:class:`~parallel_state_ng.releases.facts.ReleaseFacts`).
FACTS: ReleaseFacts = release_facts(RELEASE)
