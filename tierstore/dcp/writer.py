"""``TieredWriter``: a DCP ``StorageWriter`` that saves to the fastest tier and commits with a marker.

Call order (torch.distributed.checkpoint 2.13, see ``StorageWriter``):

0. all ranks, ``async_save`` only: :meth:`TieredWriter.stage` copies the state into reusable buffers
   (:mod:`tierstore.dcp.staging`) on the trainer's thread, or with ``overlap=True`` on a background
   thread (:mod:`tierstore.dcp.staging.overlap`); everything below runs in the background, after the copy.
1. all ranks: :meth:`~TieredWriter.reset` (only when ``dcp.save`` gets a ``checkpoint_id``), then
   :meth:`~TieredWriter.set_up_storage_writer`. The coordinator refuses an id already committed in the
   target tier unless ``overwrite=True``.
2. all ranks: :meth:`~TieredWriter.prepare_local_plan`; coordinator:
   :meth:`~TieredWriter.prepare_global_plan` picks a fresh *generation* directory for this save.
3. all ranks: :meth:`~TieredWriter.write_data` writes the rank's items into one or two files and
   returns only when they are durable in the tier; it checksums (CRC32C) every byte as it goes and, if
   configured, refuses NaN/Inf and consults the commit gate.
4. coordinator, only if no rank failed: :meth:`~TieredWriter.finish` writes DCP's ``.metadata``, then
   the commit marker **last**. A save that fails anywhere leaves no marker: it never happened.

Committed checkpoints are immutable: a save never writes into a committed generation. ``overwrite=True``
writes a new generation and swaps the marker, so the old copy stays loadable, bit-exact, until the new
one commits; the old generation is deleted only after that.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierstore.bounded import Prober
from tierstore.checksum import crc32c, sha256_hex
from tierstore.config import Config, as_config
from tierstore.dcp.gate import CommitGate
from tierstore.dcp.mirror.groups import job_groups
from tierstore.dcp.mirror.rounds import ExchangeWaits, Round, SavedShare, worker_for
from tierstore.dcp.rank_files import RankFileWriter
from tierstore.dcp.staging import STAGERS, Pending, SlabInfo, StagedSave, Stager, StagingFuture
from tierstore.errors import (
    CheckpointExistsError,
    CommitVetoedError,
    TierstoreError,
)
from tierstore.ids import (
    checkpoint_file,
    is_checkpoint_id,
    marker_path,
    metadata_file,
    new_generation,
    rank_part_path,
    validate_checkpoint_id,
    writer_staging_dir,
)
from tierstore.killpoints import kill_point
from tierstore.owners import owner_dir_name
from tierstore.records.activity import Activity, hold
from tierstore.records.known import Elsewhere, elsewhere_for
from tierstore.records.log import highest_in
from tierstore.records.marker import (
    FileEntry,
    Manifest,
    read_manifest,
    signed,
)
from tierstore.records.mirror import mirrored_ids
from tierstore.records.parts import PartRecord
from tierstore.records.protocol import claim, drop, log_commit, publish, settle_parts
from tierstore.records.sightings import Sighting, read_sightings
from tierstore.save_metrics import SaveRecorder
from tierstore.tiers import Tier
from tierstore.topology import current_host, current_node

logger = logging.getLogger(__name__)
FILES_KEY = "__tierstore_files__"
"""Index prefix of the one extra ``WriteResult`` per rank that lists the files it wrote."""


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What a rank tells the coordinator through its local plan (``SavePlan.storage_data``)."""

    node: int
    started_at: float
    stall_s: float | None = None
    wait_s: float | None = None
    host: str = ""
    highest_seq: int = 0
    """The highest commit number this rank's node-local tiers know of (its node's commit log and
    mirrored commits): the coordinator's node may be new to the job, or not the one it was."""


@dataclasses.dataclass(frozen=True)
class RankAssignment:
    """What the coordinator tells each rank through the global plan."""

    generation: str
    rank: int
    seq: int
    world_size: int
    multi_node: bool
    node_ranks: tuple[int, ...] = ()
    """Every rank on this rank's node: its node's part is complete once all of them have written."""
    coordinator_host: str = ""
    """The coordinator's host: its node alone holds the marker (recorded in part records)."""
    settled: tuple[tuple[str, str, int | None], ...] = ()
    """The coordinator process's recent saves into the tier and their final numbers (None: failed):
    the other nodes confirm or drop their parts of them (:func:`settle_parts`)."""
    current: tuple[str, str, int | None] | None = None
    """The id's marker in the coordinator's tier when the save was planned (generation '': none)."""


@dataclasses.dataclass(frozen=True)
class RankFiles:
    """The files one rank wrote (``storage_data`` of its extra ``WriteResult``)."""

    files: tuple[FileEntry, ...]


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
            (a string) vetoes the commit (see :mod:`tierstore.dcp.gate`). Must be picklable for
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
        self._checkpoint_id = (
            None if checkpoint_id is None else validate_checkpoint_id(checkpoint_id)
        )
        self._tier: Tier | None = None
        self._rank = 0
        self._is_coordinator = True
        self._started_at = time.time()
        self._reports: list[RankReport] = []
        self._generation: str | None = None
        self._seq = 0
        self._stage_report: RankReport | None = None
        self._slab: SlabInfo | None = None
        self._pending: Pending | None = None
        self._writing: Activity | None = None
        self._writing_ends: weakref.finalize[Any, Any] | None = None
        self._elsewhere: Elsewhere | None = None
        self._round: Round | None = None
        self._waits: ExchangeWaits | None = None
        """PROCESS mode: the exchanges of saves handed to DCP's checkpoint process, not yet ended."""
        self._handover: str | None = None
        """In DCP's checkpoint process: the exchange-end record the trainer waits for."""
        self._save_metrics = SaveRecorder(self.config.metrics.directory_for(self.node))

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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tier"] = None  # rebuilt where it is used (DCP's checkpoint process)
        state["_writing"] = state["_writing_ends"] = None  # held by the process that plans it
        state["_elsewhere"] = state["_round"] = None
        state["_waits"] = None  # the trainer's alone
        state["_handover"] = self._hand_over()
        # the staging buffers stay with the trainer
        state["_pending"] = None
        # PROCESS mode pickles the writer on the thread that then waits for DCP's checkpoint
        # process: that thread carries this save, and the next stage() waits for it. The stage
        # report has been handed over with this copy.
        self._register_save_thread(in_process=False)
        self._stage_report = None
        return state

    # -- AsyncStager ------------------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | StagingFuture:
        """Copy ``state_dict`` into reusable host buffers: the trainer's stall (see :mod:`staging`).

        Called by ``dcp.async_save`` on the trainer's thread. Waits first if the previous save from
        this writer is still persisting. Returns views into the buffers, isolated from later updates.

        With ``overlap=True`` it returns at once a future of those views: the wait and the copy run
        on a background thread, and the state must not be modified until the future resolves
        (``AsyncSaveResponse.staging_completion``). A staging failure fails that future, hence both
        of the response's futures.
        """
        started_wall, started = time.time(), time.perf_counter()
        stager = self._stager_for_this_process()
        record = functools.partial(self._record_staged, (started_wall, started))
        if not self.overlap:
            return record(stager.stage(state_dict))
        # record() runs on the staging thread before the future resolves, so DCP's save thread
        # (which waits for the future) sees this save's slab, report and pending; the previous
        # save from this writer is over by then (the back-pressure wait comes first).
        return stager.stage_in_background(state_dict, record)

    def _record_staged(self, started: tuple[float, float], staged: StagedSave) -> dict[str, Any]:
        """Record a finished copy for the save that carries it; returns the staged state."""
        started_wall, started_at = started
        self._slab = staged.slab
        self._pending = staged.pending  # the save's thread reports in through this
        waited = staged.waited
        # With overlap, the time until staging_completion: the most the trainer can have waited.
        stall = time.perf_counter() - started_at
        if waited > 0.01:
            logger.warning(
                "async save waited %.3f s for the previous save to tier %s to finish persisting"
                " (or for its spare buffer); save less often, or wait for the previous future",
                waited,
                self.tier_name,
            )
        self._stage_report = RankReport(self.node, started_wall, stall, waited)
        return staged.state  # type: ignore[no-any-return]

    def _register_save_thread(self, *, in_process: bool = True) -> None:
        """The thread carrying a staged save says so: the next stage() waits for the save to be
        over (see :mod:`tierstore.dcp.staging.pending`)."""
        if self._pending is not None:
            self._pending.register(threading.current_thread(), in_process=in_process)
            self._pending = None

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Optionally, once after building the model: allocate staging buffers in the background.

        The first save otherwise pays for touching fresh memory (see the benchmark); with this, it
        copies into buffers that are already mapped. Returns at once.
        """
        self._stager_for_this_process().prepare(state_dict)

    def _stager_key(self) -> str:
        return f"{self.tier.root}|{self.tier_name}"

    def _stager_for_this_process(self) -> Stager:
        """The stager this process keeps for the tier (a forked child has its own)."""

        def directory() -> str | None:
            if not self.tier.capabilities.staging_files:
                return None  # anonymous shared memory, reused save after save
            return self.tier.local_path(writer_staging_dir(owner_dir_name()))

        return STAGERS.get().get(self._stager_key(), directory)

    def synchronize_staging(self) -> None:
        """Wait for overlapped staging in progress (``staging_completion`` says the same).

        Without ``overlap`` there is nothing to wait for: :meth:`stage` has finished copying when it
        returns. DCP itself never calls this (see ``_synchronize_after_execute``).
        """
        stager = STAGERS.get().peek(self._stager_key())
        if stager is not None:
            stager.queue.wait_until_idle()

    def close(self) -> None:
        """Release this process's staging buffers for the tier (after the last save completed),
        once this process's peer-mirror exchanges have ended (bounded by ``mirror.timeout``)."""
        if self.tier.mirror is not None and not self.wait_mirrored(self.tier.mirror.timeout):
            logger.warning("closing with a peer-mirror exchange still running (reduced redundancy)")
        if self._waits is not None:
            self._waits.close()
            self._waits = None
        self._stager_for_this_process().wait_until_idle()
        stager = STAGERS.get().discard(self._stager_key())
        if stager is not None:
            stager.close()

    # -- StorageWriter ----------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; validates ``checkpoint_id`` (a name, the same in every tier)."""
        self._register_save_thread()  # the first call DCP makes on a staged save's thread
        self._stop_writing()  # a previous save by this writer that failed after planning
        if checkpoint_id is not None:
            self._checkpoint_id = validate_checkpoint_id(checkpoint_id)
        self._generation = None
        self._reports = []

    def storage_meta(self) -> StorageMeta | None:
        """The id and a save id for DCP's metadata."""
        # DCP's first call on a save's thread when the id was given to the writer (no reset()):
        # it comes before the planner's set-up, which may fail, and the next stage waits for a
        # save that never reports in.
        self._register_save_thread()
        return StorageMeta(checkpoint_id=self._checkpoint_id, save_id=uuid.uuid4().hex)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record the rank; the coordinator refuses an already committed id unless overwriting."""
        self._rank = int(kwargs.get("rank", dist.get_rank() if dist.is_initialized() else 0))
        self._is_coordinator = is_coordinator
        self._started_at = time.time()
        self._register_save_thread()
        collectives = kwargs.get("use_collectives", True)
        if collectives is False and dist.is_initialized() and dist.get_world_size() > 1:
            raise TierstoreError("TieredWriter needs use_collectives=True (one commit marker)")
        if self._checkpoint_id is None:
            raise TierstoreError(
                "no checkpoint id: pass checkpoint_id= to dcp.save/async_save or to TieredWriter"
            )
        if self._mirrors():
            # Collective (every rank sets up every save); created once, before anything can fail.
            assert self.tier.mirror is not None
            job_groups(self.tier.mirror.timeout)
        self._look_elsewhere(is_coordinator)
        if is_coordinator and not self.overwrite:
            self._refuse_committed_id(self._checkpoint_id, read_sightings(self.tier))

    def _mirrors(self) -> bool:
        """True when this save's files go to a partner node's memory too (see docs/mirror.md)."""
        return self.tier.mirror is not None and dist.is_initialized() and dist.get_world_size() > 1

    def wait_mirrored(self, timeout: float | None = None) -> bool:
        """Wait until this process's peer-mirror exchanges of finished saves have ended (mirrored
        or recorded as reduced redundancy); False if ``timeout`` seconds passed first.

        In ``AsyncCheckpointerType.PROCESS`` mode the exchange runs in DCP's checkpoint process,
        which ends with the trainer: this waits for the exchange-end record that process writes for
        each save handed over, however the save's generation was replaced or dropped meanwhile
        (call it, or :meth:`close`, before exiting).
        """
        if self.tier.mirror is None or not self._mirrors():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not worker_for(self.tier).wait_idle(timeout):  # rounds run in this process
            return False
        if self._waits is None:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._waits.wait(left)  # rounds run in DCP's checkpoint process

    def _hand_over(self) -> str | None:
        """PROCESS mode, when DCP pickles this writer for its checkpoint process: the path of the
        record that process writes once this save's exchange has ended (see
        :class:`~tierstore.dcp.mirror.rounds.ExchangeWaits`). The records live outside the save's
        generation directory: an overwrite or retention that drops the generation meanwhile
        leaves the wait intact."""
        if self.tier.mirror is None or not self._mirrors():
            return None
        if self._waits is None:
            self._waits = ExchangeWaits(self.tier)
        return self._waits.handover()

    def _look_elsewhere(self, coordinator: bool) -> Elsewhere:
        """This process's knowledge of the tiers besides the target, read once per process at
        its first save (each tier within ``probe_timeout``): the coordinator looks at every tier,
        the other ranks at their node's node-local ones (see :mod:`tierstore.records.known`)."""
        if self._elsewhere is None:
            tiers = self.config.make_tiers(node=self.node)
            self._elsewhere = elsewhere_for(tiers)
            # Every tier, the target too: a later save of this process into another tier must not
            # ask the first one's target again (it was looked at here).
            wanted = tiers if coordinator else [t for t in tiers if t.node_local]
            self._elsewhere.look(wanted, Prober(self.config.probe_timeout))
        return self._elsewhere

    def _refuse_committed_id(self, checkpoint_id: str, sightings: dict[str, Sighting]) -> None:
        """An id committed in *any* tier is taken: saving it again without ``overwrite`` would let
        two different contents carry one id. The target tier is asked; the others are known from
        start-up, the promoter's sightings and this process's commits, never asked."""
        holder = self.tier.name if self.tier.exists(marker_path(checkpoint_id)) else None
        holder = holder or self._look_elsewhere(self._is_coordinator).holder(
            checkpoint_id, besides=self.tier.name, sightings=sightings
        )
        if holder is not None:
            raise CheckpointExistsError(
                f"checkpoint {checkpoint_id!r} is already committed in tier {holder}; pass"
                " overwrite=True to TieredWriter to replace it"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Attach this rank's node and timings for the coordinator."""
        report = self._stage_report or RankReport(node=self.node, started_at=self._started_at)
        report = dataclasses.replace(report, host=current_host(), highest_seq=self._node_highest())
        self._stage_report = None
        self._save_metrics.staged(report.stall_s, report.wait_s)
        return dataclasses.replace(plan, storage_data=report)

    def _node_highest(self) -> int:
        """The highest commit number this rank's node knows: its target tier's log, the promoter's
        sightings there, the process's start-up look, the node's mirrored commits."""
        sightings = read_sightings(self.tier)
        known = self._look_elsewhere(False).highest_known(self.tier.name, sightings)
        found = [highest_in(self.tier), known]
        if self.tier.mirror is not None:
            found += [seq or 0 for seq in mirrored_ids(self.tier).values()]
        return max(found)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: choose this save's generation and tell every rank its file prefix."""
        self._generation = new_generation()
        assert self._checkpoint_id is not None
        # Announced before any rank writes: cleanup leaves an in-flight generation alone, however
        # invisible its parts (temp files, multipart uploads, a straggler rank) or old its files.
        self._stop_writing()
        self._writing = hold(self.tier, "write", self._checkpoint_id, self._generation,
                             ttl=self.config.promote.activity_ttl)  # fmt: skip
        # A failed save's record ends with its writer (one finaliser at a time: see _stop_writing).
        self._writing_ends = weakref.finalize(
            self, _abandoned, self._writing, self._look_elsewhere(True), self.tier.name
        )
        # The commit's place in commit order (what "newest" means): the next number after the
        # highest any tier has logged, claimed create-only in the target.
        self._reports = [p.storage_data for p in plans if isinstance(p.storage_data, RankReport)]
        floor = max((r.highest_seq for r in self._reports), default=0)
        self._seq = claim(self.tier, self._checkpoint_id, self._generation, floor=floor)
        multi_node = len({r.node for r in self._reports}) > 1
        nodes = [r.node for r in self._reports]
        settled = tuple(self._look_elsewhere(True).outcomes(self.tier.name)) if multi_node else ()
        current = self._current_commit(self._checkpoint_id) if multi_node else None
        return [
            dataclasses.replace(
                plan,
                storage_data=RankAssignment(
                    self._generation, rank, self._seq, len(plans), multi_node,
                    tuple(r for r, n in enumerate(nodes) if rank < len(nodes) and n == nodes[rank]),
                    current_host(), settled, current,
                ),
            )
            for rank, plan in enumerate(plans)
        ]  # fmt: skip

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items; the future completes only when they are durable in the tier."""
        assignment = plan.storage_data
        wrote: list[FileEntry] | None = None
        began = time.time()
        kill_point("writer.planned")
        try:
            wrote, future = self._write_rank(plan, planner, assignment)
        except BaseException:
            if self._is_coordinator:  # DCP calls no finish(): the save is over, and failed
                self._stop_writing()
            self._save_metrics.failed(self._rank, self.tier_name,
                                  save_s=time.time() - self._started_at)  # fmt: skip
            raise
        finally:
            if self._mirrors():  # every rank hands over a round, even one whose write failed
                self._hand_to_mirror(assignment, wrote)
        kill_point("writer.data_written")
        ended = time.time()  # metrics: after the files are durable, off the trainer's thread
        self._save_metrics.written(self._rank, self.tier_name, nbytes=sum(f.size for f in wrote),
                                   write_s=ended - began, save_s=ended - self._started_at)  # fmt: skip
        return future

    def _hand_to_mirror(self, assignment: object, files: list[FileEntry] | None) -> None:
        assert self._checkpoint_id is not None and self.tier.mirror is not None
        done = isinstance(assignment, RankAssignment) and files is not None
        share = SavedShare(
            self._checkpoint_id,
            assignment.generation if isinstance(assignment, RankAssignment) else "",
            assignment.seq if isinstance(assignment, RankAssignment) else -1,
            self._rank, self.node, current_host(), tuple(files or ()), done, self._is_coordinator,
        )  # fmt: skip
        keep = self.config.tier(self.tier_name).keep
        ttl = self.config.promote.activity_ttl
        self._round = Round(share, self.tier, self.tier.mirror, keep, ttl,
                            ended_record=self._handover)  # fmt: skip
        self._handover = None  # one save per copy of the writer; said once
        worker_for(self.tier).submit(self._round)

    def _write_rank(
        self, plan: SavePlan, planner: SavePlanner, assignment: object
    ) -> tuple[list[FileEntry], Future[list[WriteResult]]]:
        if not isinstance(assignment, RankAssignment):
            raise TierstoreError("the global plan carries no tierstore assignment (plan caching?)")
        assert self._checkpoint_id is not None
        ckpt, gen, rank = self._checkpoint_id, assignment.generation, assignment.rank
        files = RankFileWriter(
            self.tier, ckpt, gen, rank, node=self.node, slab=self._slab,
            check_finite=self.check_finite,
        )  # fmt: skip
        # A rank on another node than the coordinator's announces its part in its own node's tier
        # until the part record is durable: that node's cleanup never sees the coordinator's
        # record, and would otherwise take a straggler's data for a failed save's leftovers.
        announced = self._announce_part(ckpt, gen, assignment)
        if announced is not None:  # a node that never sees the coordinator's markers learns here
            settle_parts(self.tier, list(assignment.settled), current=assignment.current,
                         ttl=self.config.promote.activity_ttl)  # fmt: skip
        try:
            out = files.write(plan.items, planner)
            if self.commit_gate is not None and out.gate is not None:
                reason = self.commit_gate(out.gate)
                if reason:
                    raise CommitVetoedError(
                        f"commit gate vetoed checkpoint {ckpt!r} on rank {rank}: {reason}"
                    )
            if self.tier.node_local and assignment.multi_node:
                # Other nodes' promoters never see the coordinator's marker: tell them here.
                record = PartRecord(ckpt, gen, self.node, (rank,), tuple(out.files), assignment.seq,
                                    assignment.world_size, node_ranks=assignment.node_ranks,
                                    coordinator_host=assignment.coordinator_host)  # fmt: skip
                files.out.written.append(rank_part_path(ckpt, gen, rank))
                self.tier.write_bytes(rank_part_path(ckpt, gen, rank), record.to_json())
                # Every node's log learns the number: whichever node coordinates next continues
                # from it (the coordinator's node may be replaced, or swap places).
                log_commit(self.tier, assignment.seq, ckpt, gen)
        except BaseException:
            for path in files.out.written:  # invisible without a marker, but leave no garbage
                _quietly(functools.partial(self.tier.delete, path))
            raise
        finally:
            if announced is not None:
                announced.release()
        results = [
            *out.results,
            WriteResult(MetadataIndex(f"{FILES_KEY}{rank}"), 0, RankFiles(tuple(out.files))),
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return list(out.files), future

    def _announce_part(self, ckpt: str, gen: str, assignment: RankAssignment) -> Activity | None:
        """A ``write`` record in this rank's node-local tier while it writes its part of a
        multi-node save, when the coordinator's record (in its own node's tier) cannot cover it."""
        if not (self.tier.node_local and assignment.multi_node) or self._is_coordinator:
            return None
        return hold(self.tier, "write", ckpt, gen, ttl=self.config.promote.activity_ttl)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``.metadata``, re-check every file, then publish the marker last."""
        ckpt, gen = self._checkpoint_id, self._generation
        if ckpt is None or gen is None:
            raise TierstoreError("finish() called without a planned save")
        mirror, self._round = self._round, None
        try:
            manifest = self._commit(ckpt, gen, metadata, results)
        except BaseException as exc:
            published = self._published(ckpt, gen)
            self._stop_writing(committed=published is not None)
            if mirror is not None:
                self._tell_mirror_of_failure(mirror, published, exc)
            self._record_commit(published)
            raise
        kill_point("writer.committed")
        self._stop_writing(committed=True)
        if mirror is not None:
            mirror.outcome.committed(manifest.to_json())
        self._record_commit(manifest)

    def _record_commit(self, manifest: Manifest | None) -> None:
        """Metrics: the coordinator committed the save (``manifest``), or it failed (None)."""
        if manifest is None:
            self._save_metrics.failed(self._rank, self.tier_name)
        else:
            commit_s = float(manifest.timings.get("commit_s") or 0.0)
            self._save_metrics.committed(self._rank, self.tier_name, commit_s=commit_s)

    def _marker(self, ckpt: str) -> Manifest | None:
        """The id's marker in the target now; None when there is none (or none readable)."""
        try:
            return read_manifest(self.tier, ckpt)
        except Exception:  # noqa: BLE001 - no marker, or none readable: no commit to speak of
            return None

    def _current_commit(self, ckpt: str) -> tuple[str, str, int | None]:
        """``(id, generation, seq)`` of the id's marker in the target ('' and None: none)."""
        marker = self._marker(ckpt)
        return (ckpt, "", None) if marker is None else (ckpt, marker.generation, marker.seq)

    def _published(self, ckpt: str, gen: str) -> Manifest | None:
        """The marker naming this save's generation, if its publish happened after all (a publish
        can fail after its rename); None: the save did not commit."""
        marker = self._marker(ckpt)
        return marker if marker is not None and marker.generation == gen else None

    @staticmethod
    def _tell_mirror_of_failure(
        mirror: Round, published: Manifest | None, exc: BaseException
    ) -> None:
        """A failed commit is final only if no marker names the generation: the exchange then
        removes the save's files on every node."""
        if published is not None:
            mirror.outcome.committed(published.to_json())
        else:
            mirror.outcome.failed(f"{type(exc).__name__}: {exc}")

    def _commit(
        self, ckpt: str, gen: str, metadata: Metadata, results: list[list[WriteResult]]
    ) -> Manifest:
        files: list[FileEntry] = []
        storage: dict[MetadataIndex, Any] = {}
        for rank_results in results:
            for result in rank_results:
                if isinstance(result.storage_data, RankFiles):
                    files.extend(result.storage_data.files)
                else:
                    storage[result.index] = result.storage_data
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        meta_rel = metadata_file(gen)
        self.tier.write_bytes(checkpoint_file(ckpt, meta_rel), blob)
        kill_point("writer.metadata_written")
        keys = self.tier.signing
        digest = sha256_hex(blob) if keys is not None else None
        files.append(FileEntry(meta_rel, len(blob), crc32c(blob), None, self.node, digest))
        sightings = read_sightings(self.tier)
        elsewhere = self._look_elsewhere(True)
        manifest = Manifest(
            checkpoint_id=ckpt,
            generation=gen,
            world_size=len(results),
            files=tuple(sorted(files, key=lambda f: f.path)),
            timings=self._timings(time.time()),
            topology=self._topology(),
            seq=self._seq_at_commit(ckpt, gen, elsewhere.highest_known(self.tier.name, sightings)),
            overwrite=self.overwrite,
            unseen_tiers=tuple(elsewhere.unseen(self.tier.name, sightings)),
            namespace=self.config.namespace or "",
        )
        manifest = signed(manifest, keys)  # last: the signature covers every field above
        ttl = self.config.promote.activity_ttl
        try:
            if not self.overwrite:
                self._refuse_committed_id(
                    ckpt, sightings
                )  # one id, one content: again, just before
            replaced = self._marker(ckpt) if self.overwrite else None
            existing = publish(self.tier, manifest, replace=self.overwrite, node=self.node,
                               log=False, ttl=ttl)  # fmt: skip
            if existing is not None:
                raise CheckpointExistsError(
                    f"checkpoint {ckpt!r} was committed in tier {self.tier.describe()} by another"
                    " writer while this save was running; this save was discarded"
                )
        except CheckpointExistsError:
            self._stop_writing()  # this save's own record would keep its files
            _quietly(lambda: drop(self.tier, ckpt, gen, committed=False, ttl=ttl))
            raise
        elsewhere.committed(self.tier.name, ckpt, manifest.seq or 0, gen)
        if replaced is not None and replaced.generation != gen:  # dropped: so are its parts
            elsewhere.failed(self.tier.name, ckpt, replaced.generation)  # elsewhere, next plan
        logger.info(
            "committed %s in tier %s (%d bytes)", ckpt, self.tier.name, manifest.total_bytes
        )
        return manifest

    def _seq_at_commit(self, ckpt: str, gen: str, known: int) -> int:
        """The sequence number the marker carries: the one claimed when the save was planned,
        unless another save has taken a higher one since in this tier, or a higher one became known
        elsewhere (a save that started later but committed first, a zombie job's late overwrite):
        then a new one, so that commit order is the order in which commits happened. A multi-node
        save too: the other nodes' part records keep the number claimed at planning until it is
        confirmed (its mirror exchange, this coordinator's next plan, or the promoter reading the
        job-wide tier: design.md, rule 2)."""
        # ``known`` never holds this save's own claim: a number there equal to it is another
        # commit's (a save into another tier that took the same number meanwhile).
        if highest_in(self.tier) > self._seq or known >= self._seq:
            self._seq = claim(self.tier, ckpt, gen, floor=known)
        return self._seq

    def _stop_writing(self, *, committed: bool = False) -> None:
        """End the planned save's ``write`` record; a save that ends without committing (a veto, a
        failure on any rank, a refusal) is remembered as failed: the other nodes drop their parts
        of it at the next save's plan (:func:`settle_parts`)."""
        if self._writing_ends is not None:
            self._writing_ends.detach()  # a writer reused for many saves keeps none of the old ones
            self._writing_ends = None
        if self._writing is not None:
            _abandoned(self._writing, None if committed else self._elsewhere, self.tier_name)
            self._writing = None

    def _topology(self) -> dict[str, Any] | None:
        """The saving job's nodes and hosts, recorded when the tier mirrors (placement input)."""
        if self.tier.mirror is None:
            return None
        hosts = {str(r.node): r.host for r in self._reports}
        return {"hosts": hosts, "mirror_stride": self.tier.mirror.stride}

    def _timings(self, committed_at: float) -> dict[str, float | None]:
        started = min((r.started_at for r in self._reports), default=self._started_at)
        stalls = [r.stall_s for r in self._reports if r.stall_s is not None]
        waits = [r.wait_s for r in self._reports if r.wait_s is not None]
        return {
            "started_at": started,
            "stall_s": max(stalls) if stalls else committed_at - started,
            "wait_s": max(waits) if waits else None,
            "commit_s": committed_at - started,
        }


def _abandoned(writing: Activity, elsewhere: Elsewhere | None, tier_name: str) -> None:
    """A planned save's ``write`` record ends; with ``elsewhere``, the save did not commit (also
    when its writer is collected mid-save: a failure before ``finish``)."""
    writing.release()
    if elsewhere is not None and writing.generation is not None:
        elsewhere.failed(tier_name, writing.checkpoint_id, writing.generation)


def _quietly(action: Callable[[], object]) -> None:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - best-effort cleanup; gc removes what is left
        logger.warning("cleanup failed: %s", exc)
