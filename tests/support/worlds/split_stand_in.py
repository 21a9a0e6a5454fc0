"""The gloo stand-in for NCCL's split, re-exported: it lives in
:mod:`parallel_state_ng.testing.split_stand_in` (the scripts use it too).
"""

from parallel_state_ng.testing.split_stand_in import gloo_split, install

__all__ = ["gloo_split", "install"]
