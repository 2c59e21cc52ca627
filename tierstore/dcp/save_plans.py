"""The plans a save exchanges between ranks (DCP steps 1-2).

Each rank reports its node, timings and the highest commit number its node knows
(:class:`RankReport`, in its local plan); the coordinator chooses the save's fresh generation and
claims its commit number, then tells every rank its part (:class:`RankAssignment`, in the global
plan). Each rank's files come back to the coordinator in one extra ``WriteResult``
(:class:`RankFiles`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan

from tierstore.dcp.known_commits import current_commit, look_elsewhere, refuse_committed_id
from tierstore.dcp.mirror_handoff import open_groups
from tierstore.dcp.save_activity import start_writing
from tierstore.errors import TierstoreError
from tierstore.ids import new_generation
from tierstore.records.log import highest_in
from tierstore.records.marker import FileEntry
from tierstore.records.mirror import mirrored_ids
from tierstore.records.protocol import claim
from tierstore.records.sightings import read_sightings
from tierstore.topology import current_host

if TYPE_CHECKING:
    from tierstore.dcp.writer import TieredWriter

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


def set_up(writer: TieredWriter, is_coordinator: bool, kwargs: dict[str, Any]) -> None:
    """Every rank, step 1: record the rank; the coordinator refuses an already committed id
    unless overwriting.

    Raises:
        TierstoreError: ``use_collectives=False`` in a multi-rank job, or no checkpoint id.
        CheckpointExistsError: the id is committed in some tier and the writer does not overwrite.
    """
    writer._rank = int(kwargs.get("rank", dist.get_rank() if dist.is_initialized() else 0))
    writer._is_coordinator = is_coordinator
    writer._started_at = time.time()
    collectives = kwargs.get("use_collectives", True)
    if collectives is False and dist.is_initialized() and dist.get_world_size() > 1:
        raise TierstoreError("TieredWriter needs use_collectives=True (one commit marker)")
    if writer._checkpoint_id is None:
        raise TierstoreError(
            "no checkpoint id: pass checkpoint_id= to dcp.save/async_save or to TieredWriter"
        )
    open_groups(writer)
    look_elsewhere(writer, is_coordinator)
    if is_coordinator and not writer.overwrite:
        refuse_committed_id(writer, writer._checkpoint_id, read_sightings(writer.tier))


def local_plan(writer: TieredWriter, plan: SavePlan) -> SavePlan:
    """Every rank, step 2: attach this rank's report (node, host, timings, highest number)."""
    report = writer._stage_report or RankReport(node=writer.node, started_at=writer._started_at)
    report = dataclasses.replace(report, host=current_host(), highest_seq=_node_highest(writer))
    writer._stage_report = None
    writer._save_metrics.staged(report.stall_s, report.wait_s)
    return dataclasses.replace(plan, storage_data=report)


def _node_highest(writer: TieredWriter) -> int:
    """The highest commit number this rank's node knows: its target tier's log, the promoter's
    sightings there, the process's start-up look, the node's mirrored commits."""
    tier = writer.tier
    sightings = read_sightings(tier)
    known = look_elsewhere(writer, False).highest_known(tier.name, sightings)
    found = [highest_in(tier, above=known)]
    if tier.mirror is not None:
        found += [seq or 0 for seq in mirrored_ids(tier).values()]
    return max(found)


def global_plan(writer: TieredWriter, plans: list[SavePlan]) -> list[SavePlan]:
    """Coordinator, step 2: choose this save's generation, claim its commit number and tell every
    rank its part."""
    ckpt = writer._checkpoint_id
    assert ckpt is not None
    gen = writer._generation = new_generation()
    # Announced before any rank writes: cleanup leaves an in-flight generation alone, however
    # invisible its parts (temp files, multipart uploads, a straggler rank) or old its files.
    start_writing(writer, ckpt, gen)
    # The commit's place in commit order (what "newest" means): the next number after the
    # highest any tier has logged, claimed create-only in the target.
    reports = writer._reports = [p.storage_data for p in plans if isinstance(p.storage_data, RankReport)]
    floor = max((r.highest_seq for r in reports), default=0)
    seq = writer._seq = claim(writer.tier, ckpt, gen, floor=floor)
    multi_node = len({r.node for r in reports}) > 1
    nodes = [r.node for r in reports]
    settled = tuple(look_elsewhere(writer, True).outcomes(writer.tier.name)) if multi_node else ()
    current = current_commit(writer, ckpt) if multi_node else None
    return [
        dataclasses.replace(
            plan,
            storage_data=RankAssignment(
                gen,
                rank,
                seq,
                len(plans),
                multi_node,
                tuple(r for r, n in enumerate(nodes) if rank < len(nodes) and n == nodes[rank]),
                current_host(),
                settled,
                current,
            ),
        )
        for rank, plan in enumerate(plans)
    ]
