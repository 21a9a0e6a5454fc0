"""The gloo stand-in for ``torch.distributed.shrink_group``, re-exported: it lives in
:mod:`parallel_state_ng.testing.shrink_stand_in` (the scripts use it too). ``calls`` is the
same list the stand-in appends to.
"""

from parallel_state_ng.testing.shrink_stand_in import calls, gloo_shrink

__all__ = ["calls", "gloo_shrink"]
