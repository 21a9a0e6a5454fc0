"""Process groups as side effects: creation, names, sharing, agreement, liveness, abort, destroy.

Holds the one build pipeline (:mod:`.pipeline`) that compat's init and every builder call.
See docs/architecture.md.
"""
