"""One rank's part of one save, from ``set_up_storage_writer`` to ``finish`` or the failure (the
writer keeps only what outlives a save), and what its ranks tell each other.

The coordinator's session holds the save's ``write`` record from its plan to the end of its commit:
cleanup leaves a generation with a live one alone, however invisible its parts. A save that ends
without committing (a veto, a failure on any rank, a refusal, a writer collected mid-save) is
remembered as failed: the other nodes drop their parts of it at the next plan (``settle_parts``).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable
from typing import Any

from tierstore._platform.runtime import finalize
from tierstore._platform.save_metrics import SaveRecorder
from tierstore.config import Config
from tierstore.dcp.mirror import Round
from tierstore.dcp.save.gate import CommitGate
from tierstore.dcp.staging import SlabInfo
from tierstore.placement import MirrorConfig
from tierstore.records.activity import Activity, hold
from tierstore.records.known import Elsewhere
from tierstore.records.marker import FileEntry
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

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


@dataclasses.dataclass(eq=False)
class SaveSession:
    """One rank's part of one save: the writer's settings, then what the steps fill in."""

    config: Config
    tier: Tier  # the target, as the process that saves sees it
    tier_name: str
    trust: MarkerTrust  # the markers it reads: the job's namespace, signed by its keys
    mirror: MirrorConfig | None  # how the target is mirrored into a partner node's memory
    node: int
    overwrite: bool
    check_finite: bool
    commit_gate: CommitGate | None
    metrics: SaveRecorder
    look_elsewhere: Callable[[bool], Elsewhere]  # the writer's look at the other tiers, taken once
    checkpoint_id: str
    rank: int
    is_coordinator: bool
    slab: SlabInfo | None  # of the last staged state (a retry of that state re-uses it)
    handover: str | None  # PROCESS mode: the exchange-end record the trainer waits for
    started_at: float = dataclasses.field(default_factory=time.time)
    generation: str | None = None
    seq: int = 0  # claimed at planning (claimed again at commit if overtaken)
    reports: list[RankReport] = dataclasses.field(default_factory=list)
    writing: Activity | None = None
    writing_ends: weakref.finalize[Any, Any] | None = None
    round: Round | None = None

    def start_writing(self) -> None:
        """Coordinator, before any rank writes: announce the save's generation in the target tier."""
        ttl, elsewhere = self.config.promote.activity_ttl, self.look_elsewhere(True)
        self.writing = hold(self.tier, "write", self.checkpoint_id, self.generation, ttl=ttl)
        # A failed save's record ends with its session (the writer keeps it until its next save).
        self.writing_ends = finalize(self, _abandoned, self.writing, elsewhere, self.tier.name)

    def stop_writing(self, *, committed: bool = False) -> None:
        """End the planned save's ``write`` record; without ``committed`` the save is remembered as
        failed in this process's knowledge of the tiers."""
        if self.writing_ends is not None:
            self.writing_ends.detach()
            self.writing_ends = None
        if self.writing is not None:
            _abandoned(self.writing, None if committed else self.look_elsewhere(True), self.tier_name)
            self.writing = None


def _abandoned(writing: Activity, elsewhere: Elsewhere | None, tier_name: str) -> None:
    """A planned save's ``write`` record ends; with ``elsewhere``, the save did not commit (also
    when its session is collected mid-save: a failure before ``finish``)."""
    writing.release()
    if elsewhere is not None and writing.generation is not None:
        elsewhere.failed(tier_name, writing.checkpoint_id, writing.generation)
