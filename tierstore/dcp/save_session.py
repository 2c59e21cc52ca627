"""One rank's part of one save: the state the writer's steps share, from ``set_up_storage_writer``
(where the rank and its role are known) to ``finish`` or the failure. The writer keeps only what
outlives a save: its settings, the tier, the process's knowledge of other tiers, the stage hand-off."""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import StorageMeta

from tierstore._platform.save_metrics import SaveRecorder
from tierstore.config import Config
from tierstore.dcp.gate import CommitGate
from tierstore.dcp.mirror.rounds import Round
from tierstore.dcp.save_messages import RankReport
from tierstore.dcp.staging import SlabInfo
from tierstore.records.activity import Activity
from tierstore.records.known import Elsewhere
from tierstore.tiers import Tier


@dataclasses.dataclass(eq=False)
class SaveSession:
    """One rank's part of one save. The writer's settings are fixed for the save; the coordinator's
    fields are filled by its plan (step 2); ``round`` goes from a rank's write to the commit."""

    config: Config
    tier: Tier
    """The target, as the process that saves sees it."""
    tier_name: str
    node: int
    overwrite: bool
    check_finite: bool
    commit_gate: CommitGate | None
    metrics: SaveRecorder
    look_elsewhere: Callable[[bool], Elsewhere]
    """The process's knowledge of the other tiers, read at its first save (the writer keeps it)."""
    checkpoint_id: str
    rank: int
    is_coordinator: bool
    started_at: float
    slab: SlabInfo | None
    """The slab of the last staged state (a retry of that state re-uses it)."""
    handover: str | None
    """PROCESS mode: the exchange-end record the trainer waits for (said once)."""
    generation: str | None = None
    seq: int = 0
    """The commit number claimed at planning (claimed again at commit if overtaken)."""
    reports: list[RankReport] = dataclasses.field(default_factory=list)
    writing: Activity | None = None
    """The planned save's ``write`` record, and below the finaliser that ends it with the session."""
    writing_ends: weakref.finalize[Any, Any] | None = None
    round: Round | None = None

    def storage_meta(self) -> StorageMeta:
        """The id and a save id for DCP's metadata."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=uuid.uuid4().hex)
