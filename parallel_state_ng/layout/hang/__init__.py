"""Why a job hangs, from what each rank last did on each group and the layout (pure).

:mod:`.records` holds what a rank did (:class:`OpRecord`, :class:`RankRecord`);
:mod:`.place` maps a group to its kinds, coordinates and ranks through the layout;
:mod:`.waits` follows the chain of waits to the culprit (:func:`diagnose`);
:mod:`.report` renders a :class:`Diagnosis`; :mod:`.flight_recorder` reads and writes torch's
flight-recorder dumps. No ``torch.distributed`` here: the live side is
:mod:`parallel_state_ng.groups.hang_watch`.
"""

from parallel_state_ng.layout.hang.flight_recorder import read_dump_dir, record_of_dump, records_dump
from parallel_state_ng.layout.hang.place import GroupPlace, Placer
from parallel_state_ng.layout.hang.records import OpRecord, RankRecord
from parallel_state_ng.layout.hang.report import render
from parallel_state_ng.layout.hang.waits import Diagnosis, Wait, diagnose

__all__ = [
    "Diagnosis",
    "GroupPlace",
    "OpRecord",
    "Placer",
    "RankRecord",
    "Wait",
    "diagnose",
    "read_dump_dir",
    "record_of_dump",
    "records_dump",
    "render",
]
