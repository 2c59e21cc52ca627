"""Staging for ``async_save``: the trainer's copy of its state into reusable host buffers.

The face is a process's :class:`Stager` per target tier (:data:`STAGERS`): ``stage(state)`` (or
``stage_in_background``, overlapped) returns a :class:`StagedSave`, the staged state with its slab,
its wait and its :class:`Pending` save. The writer knows nothing else of staging.

Inside: :mod:`.stager` (slabs, the spare, the back-pressure wait), :mod:`.copier` (the copy),
:mod:`.overlap` (the copy on a background thread), :mod:`.pending` and :mod:`.save_events` (when a
staged save is over), :mod:`.slab_use` (who reads or writes a slab now), :mod:`.staged_shard`
(DTensor shards), :mod:`.now` (the peer mirror pauses while this process stages).
"""

from tierstore.dcp.staging.now import STAGING_NOW
from tierstore.dcp.staging.overlap import StagingFuture
from tierstore.dcp.staging.pending import Pending
from tierstore.dcp.staging.slab_use import use_of
from tierstore.dcp.staging.stager import STAGERS, SlabInfo, StagedSave, Stager

__all__ = ["STAGERS", "STAGING_NOW", "Pending", "SlabInfo", "StagedSave", "Stager", "StagingFuture", "use_of"]
