"""What ranks tell each other during a save (DCP steps 1-3): each rank's report in its local plan
(:class:`RankReport`), the coordinator's assignment in the global plan (:class:`RankAssignment`),
and the files each rank wrote, in one extra ``WriteResult`` (:class:`RankFiles`)."""

from __future__ import annotations

import dataclasses

from tierstore.records.marker import FileEntry

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
