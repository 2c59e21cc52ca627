"""``TieredWriter``: a DCP ``StorageWriter`` that saves to the fastest tier and commits with a marker.

Call order (torch.distributed.checkpoint 2.13, see ``StorageWriter``):

0. all ranks, ``async_save`` only: :meth:`TieredWriter.stage` copies the state into reusable buffers
   (:mod:`tierstore.dcp.save.stage`, :mod:`tierstore.dcp.staging`) on the trainer's thread, or with
   ``overlap=True`` on a background thread; everything below runs in the background, after the copy.
1. all ranks: :meth:`~TieredWriter.reset` (only when ``dcp.save`` gets a ``checkpoint_id``), then
   :meth:`~TieredWriter.set_up_storage_writer`. The coordinator refuses an id already committed in
   any tier unless ``overwrite=True`` (:mod:`tierstore.dcp.save.plans`,
   :mod:`tierstore.dcp.save.commit`).
2. all ranks: :meth:`~TieredWriter.prepare_local_plan`; coordinator:
   :meth:`~TieredWriter.prepare_global_plan` picks a fresh *generation* directory for this save and
   claims its commit number (:mod:`tierstore.dcp.save.plans`).
3. all ranks: :meth:`~TieredWriter.write_data` writes the rank's items into one or two files and
   returns only when they are durable in the tier; it checksums (CRC32C) every byte as it goes and, if
   configured, refuses NaN/Inf and consults the commit gate (:mod:`tierstore.dcp.save.rank_write`); with a
   peer mirror, it then hands its files to the exchange (:mod:`tierstore.dcp.save.mirror_handoff`).
4. coordinator, only if no rank failed: :meth:`~TieredWriter.finish` writes DCP's ``.metadata``, then
   the commit marker **last** (:mod:`tierstore.dcp.save.commit`). A save that fails anywhere leaves no
   marker: it never happened.

Committed checkpoints are immutable: a save never writes into a committed generation. ``overwrite=True``
writes a new generation and swaps the marker, so the old copy stays loadable, bit-exact, until the new
one commits; the old generation is deleted only after that.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierstore._platform.bounded import Prober
from tierstore._platform.save_metrics import SaveRecorder
from tierstore.config import Config, as_config
from tierstore.dcp.save import commit, rank_write
from tierstore.dcp.save import plans as save_plans
from tierstore.dcp.save.gate import CommitGate
from tierstore.dcp.save.mirror_handoff import MirrorWaits
from tierstore.dcp.save.session import SaveSession
from tierstore.dcp.save.stage import StageHandoff, release, stager_for_this_process, wait_for_staging
from tierstore.dcp.staging import Stager, StagingFuture
from tierstore.errors import TierstoreError
from tierstore.ids import is_checkpoint_id, validate_checkpoint_id
from tierstore.records.known import Elsewhere, elsewhere_for
from tierstore.tiers import Tier
from tierstore.topology import current_node

logger = logging.getLogger("tierstore.dcp.writer")  # the name users configure (moved from there)


class TieredWriter(StorageWriter, AsyncStager):
    """Save DCP checkpoints into a tier (the first, fastest one by default) with a commit marker.

    Args:
        config: a loaded :class:`~tierstore.config.Config` or the path of a YAML file.
        checkpoint_id: the id to save under when ``dcp.save`` is called without one.
        tier: the name of the tier to write to (default: the first). Use the last one to send a final
            checkpoint straight to durable storage.
        overwrite: replace a checkpoint already committed under this id (atomically: see module doc).
        node: this process's node index for node-local tiers (default: :func:`current_node`).
        commit_gate: called on each rank with the data it is about to commit; returning a reason
            (a string) vetoes the commit (see :mod:`tierstore.dcp.save.gate`). Must be picklable for
            ``AsyncCheckpointerType.PROCESS``.
        check_finite: refuse to commit NaN/Inf in floating tensors (default: the config's).
        overlap: stage in the background (default: the config's ``staging.overlap``): ``async_save``
            then returns an ``AsyncSaveResponse`` at once; the trainer must not modify the state
            until its ``staging_completion`` has resolved.

    Raises (through DCP, which wraps them in ``CheckpointException``):
        :class:`~tierstore.errors.CheckpointExistsError`, :class:`~tierstore.errors.CommitVetoedError`,
        :class:`~tierstore.errors.TierUnavailableError`, :class:`~tierstore.errors.InvalidCheckpointIdError`.
    """

    def __init__(
        self,
        config: Config | str | os.PathLike[str],
        *,
        checkpoint_id: str | None = None,
        tier: str | None = None,
        overwrite: bool = False,
        node: int | None = None,
        commit_gate: CommitGate | None = None,
        check_finite: bool | None = None,
        overlap: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = as_config(config)
        self.tier_name = self.config.tier(tier).name if tier else self.config.tiers[0].name
        self.overwrite = overwrite
        self.node = current_node(node)
        self.commit_gate = commit_gate
        self.check_finite = self.config.check_finite if check_finite is None else check_finite
        self.overlap = self.config.staging.overlap if overlap is None else overlap
        self._checkpoint_id = None if checkpoint_id is None else validate_checkpoint_id(checkpoint_id)
        self.trust = self.config.marker_trust()
        """Which markers it reads: its namespace's, signed by the job's keys (read once)."""
        self._tier: Tier | None = None
        self._elsewhere: Elsewhere | None = None
        self._staged = StageHandoff(self.node, self.tier_name)
        self._waits = MirrorWaits(self.config.mirror_of(self.tier_name))
        self._handover: str | None = None  # in DCP's checkpoint process: the record the trainer awaits
        self._save_metrics = SaveRecorder(self.config.metrics.directory_for(self.node))
        self._session: SaveSession | None = None  # the save in progress, or the last one

    # DCP calls stage() and returns; it must not call the deprecated synchronize_staging().
    _synchronize_after_execute = False

    # -- identity -------------------------------------------------------------------------------

    @property
    def checkpoint_id(self) -> str | None:
        """The id of the save in progress (or the one given at construction)."""
        return self._checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when ``checkpoint_id`` is a valid tierstore id (a plain name)."""
        return isinstance(checkpoint_id, str) and is_checkpoint_id(checkpoint_id)

    @property
    def tier(self) -> Tier:
        """The target tier, as seen from this process's node."""
        if self._tier is None:
            self._tier = self.config.make_tier(self.tier_name, node=self.node)
        return self._tier

    def _look_elsewhere(self, coordinator: bool) -> Elsewhere:
        """This process's knowledge of the other tiers, read at its first save (once)."""
        if self._elsewhere is None:
            tiers = self.config.make_tiers(node=self.node)
            self._elsewhere = elsewhere_for(tiers)
            # The coordinator every tier, the target too (a later save into another tier must not ask
            # the first one's target again), the other ranks their node's node-local ones.
            wanted = tiers if coordinator else [t for t in tiers if t.node_local]
            self._elsewhere.look(wanted, Prober(self.config.probe_timeout), self.trust)
        return self._elsewhere

    def _current(self) -> SaveSession:
        if self._session is None:
            raise TierstoreError("no save set up: DCP calls set_up_storage_writer() first")
        return self._session

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tier"] = None  # rebuilt where it is used (DCP's checkpoint process)
        state["_elsewhere"] = state["_session"] = None  # the process that saves has its own
        state["_waits"] = MirrorWaits(self._waits.mirror)  # the trainer's alone
        state["_handover"] = self._waits.hand_over(self.tier)
        # The slab and stage report go with this copy (a snapshot, taken before the two lines
        # below change the trainer's), the staging buffers and the pending save stay.
        state["_staged"] = dataclasses.replace(self._staged, pending=None, carried=None, last=None)
        # PROCESS mode pickles the writer on the thread that then waits for DCP's checkpoint
        # process: that thread carries this save, and the next stage() waits for it.
        self._staged.register_thread(in_process=False)
        self._staged.report = None
        return state

    # -- 0. AsyncStager ---------------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | StagingFuture:
        """Copy ``state_dict`` into reusable host buffers: the trainer's stall (see :mod:`staging`).

        Called by ``dcp.async_save`` on the trainer's thread. Waits first if the previous save from
        this writer is still persisting. Returns views into the buffers, isolated from later updates.

        With ``overlap=True`` it returns at once a future of those views: the wait and the copy run
        on a background thread, and the state must not be modified until the future resolves
        (``AsyncSaveResponse.staging_completion``). A staging failure fails that future, hence both
        of the response's futures.
        """
        return self._staged.stage(self._stager_for_this_process, state_dict, self.overlap)

    def over_when(self, future: concurrent.futures.Future[Any]) -> None:
        """The save this writer staged last is over when ``future`` (its ``dcp.async_save``'s) is
        done: the next :meth:`stage` waits for that, not for what the carrier thread implies. For
        callers that own the future (:class:`~tierstore.dcp.manager.CheckpointManager`)."""
        last = self._staged.last
        if last is not None:
            future.add_done_callback(lambda _done: last.finish())

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Optionally, once after building the model: allocate staging buffers in the background.

        The first save otherwise pays for touching fresh memory (see the benchmark); with this, it
        copies into buffers that are already mapped. Returns at once.
        """
        self._stager_for_this_process().prepare(state_dict)

    def _stager_for_this_process(self) -> Stager:
        """The stager this process keeps for the tier (a forked child has its own)."""
        return stager_for_this_process(self.tier, self.tier_name)

    def synchronize_staging(self) -> None:
        """Wait for overlapped staging in progress (``staging_completion`` says the same).

        Without ``overlap`` there is nothing to wait for: :meth:`stage` has finished copying when it
        returns. DCP itself never calls this (see ``_synchronize_after_execute``).
        """
        wait_for_staging(self.tier, self.tier_name)

    def close(self) -> None:
        """Release this process's staging buffers for the tier (after the last save completed),
        once this process's peer-mirror exchanges have ended (bounded by ``mirror.timeout``)."""
        if not self._waits.end(self.tier):
            logger.warning("closing with a peer-mirror exchange still running (reduced redundancy)")
        release(self.tier, self.tier_name)

    def wait_mirrored(self, timeout: float | None = None) -> bool:
        """Wait until this process's peer-mirror exchanges of finished saves have ended (mirrored
        or recorded as reduced redundancy); False if ``timeout`` seconds passed first.

        In ``AsyncCheckpointerType.PROCESS`` mode the exchange runs in DCP's checkpoint process,
        which ends with the trainer: this waits for the exchange-end record that process writes for
        each save handed over, however the save's generation was replaced or dropped meanwhile
        (call it, or :meth:`close`, before exiting).
        """
        return self._waits.wait(self.tier, timeout)

    # -- 1. set-up ----------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; validates ``checkpoint_id`` (a name, the same in every tier)."""
        self._staged.register_thread()  # the first call DCP makes on a staged save's thread
        if self._session is not None:  # a previous save that failed after planning: its record ends
            self._session.stop_writing()
        if checkpoint_id is not None:
            self._checkpoint_id = validate_checkpoint_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        """The id and a save id for DCP's metadata."""
        # DCP's first call on a save's thread when the id was given to the writer (no reset()):
        # it comes before the planner's set-up, which may fail, and the next stage waits for a
        # save that never reports in.
        self._staged.register_thread()
        return StorageMeta(checkpoint_id=self._checkpoint_id, save_id=uuid.uuid4().hex)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record the rank; the coordinator refuses an already committed id unless overwriting."""
        self._staged.register_thread()
        if self._session is not None:  # the previous save's write record ends (if it failed)
            self._session.stop_writing()
        checkpoint_id, rank = save_plans.check_set_up(self._checkpoint_id, kwargs)
        self._session = SaveSession(
            config=self.config,
            tier=self.tier,
            tier_name=self.tier_name,
            trust=self.trust,
            mirror=self.config.mirror_of(self.tier_name),
            node=self.node,
            overwrite=self.overwrite,
            check_finite=self.check_finite,
            commit_gate=self.commit_gate,
            metrics=self._save_metrics,
            look_elsewhere=self._look_elsewhere,
            checkpoint_id=checkpoint_id,
            rank=rank,
            is_coordinator=is_coordinator,
            slab=self._staged.slab,
            handover=self._handover,
        )
        self._handover = None  # one save per copy of the writer
        self._save_metrics.started(rank, self.tier_name)
        save_plans.set_up(self._session)

    # -- 2. plans -----------------------------------------------------------------------------------

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Attach this rank's node and timings for the coordinator."""
        planned = save_plans.local_plan(self._current(), plan, self._staged.report)
        self._staged.report = None  # the stage's report went with this save's plan
        return planned

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: choose this save's generation and tell every rank its file prefix."""
        return save_plans.global_plan(self._current(), plans)

    # -- 3. the rank's write --------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items; the future completes only when they are durable in the tier."""
        session = self._current()
        written = rank_write.write_data(session, plan, planner)
        if not session.is_coordinator:  # its part ends here; the coordinator's ends in finish()
            written.then(lambda _: self._staged.settle())
        return written

    # -- 4. the commit --------------------------------------------------------------------------

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``.metadata``, re-check every file, then publish the marker last."""
        try:
            commit.finish(self._current(), metadata, results)
        finally:
            self._staged.settle()
