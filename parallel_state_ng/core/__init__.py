"""The generic engine: named-dimension layouts and the process groups over them.

Nothing here knows Megatron. :mod:`.layout` is pure rank/coordinate/group math (no
``torch.distributed``); :mod:`.grid` creates groups over a layout (:class:`HyperCommGrid`);
:mod:`.naming` names member-only groups so that every member agrees; :mod:`.handles`,
:mod:`.mesh`, :mod:`.sharing`, :mod:`.agreement` and :mod:`.objects` build on those.
"""
