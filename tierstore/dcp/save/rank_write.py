"""A rank's write (DCP step 3): its items into one or two files, durable in the tier before the
future completes, checksummed as they go; the commit gate's veto; in a multi-node save, the rank's
part record and commit number in its node's tier. Every rank then hands its share to the peer
mirror, even when its write failed."""

from __future__ import annotations

import time

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tierstore._platform.killpoints import kill_point
from tierstore.dcp.save.mirror_handoff import hand_to_mirror, mirrors
from tierstore.dcp.save.rank_files import RankFileWriter
from tierstore.dcp.save.session import FILES_KEY, RankAssignment, RankFiles, SaveSession
from tierstore.errors import CommitVetoedError, TierstoreError
from tierstore.ids import rank_part_path
from tierstore.records.activity import Activity, hold
from tierstore.records.log import LogEntry
from tierstore.records.marker import FileEntry
from tierstore.records.parts import PartRecord
from tierstore.records.protocol import discard, record_parts, settle_parts


def write_data(session: SaveSession, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
    """Write this rank's items; the future completes only when they are durable in the tier.

    Raises:
        CommitVetoedError: the commit gate refused this rank's data.
        TierstoreError: the global plan carries no tierstore assignment.
    """
    assignment = plan.storage_data
    wrote: list[FileEntry] | None = None
    began = time.time()
    metrics = session.metrics
    kill_point("writer.planned")
    try:
        wrote, future = _write_rank(session, plan, planner, assignment)
    except BaseException:
        if session.is_coordinator:  # DCP calls no finish(): the save is over, and failed
            session.stop_writing()
        metrics.failed(session.rank, session.tier_name, save_s=time.time() - session.started_at)
        raise
    finally:
        if mirrors(session.mirror):  # every rank hands over a round, even one whose write failed
            planned = isinstance(assignment, RankAssignment)
            hand_to_mirror(
                session, assignment.generation if planned else "", assignment.seq if planned else -1, wrote
            )
    kill_point("writer.data_written")
    ended = time.time()  # metrics: after the files are durable, off the trainer's thread
    metrics.written(
        session.rank,
        session.tier_name,
        nbytes=sum(f.size for f in wrote),
        write_s=ended - began,
        save_s=ended - session.started_at,
    )
    return future


def _write_rank(
    session: SaveSession, plan: SavePlan, planner: SavePlanner, assignment: object
) -> tuple[list[FileEntry], Future[list[WriteResult]]]:
    if not isinstance(assignment, RankAssignment):
        raise TierstoreError("the global plan carries no tierstore assignment (plan caching?)")
    tier = session.tier
    ckpt, gen, rank = session.checkpoint_id, assignment.generation, assignment.rank
    signed, finite = session.trust.keys is not None, session.check_finite
    files = RankFileWriter(
        tier, ckpt, gen, rank, node=session.node, slab=session.slab, check_finite=finite, sha256=signed
    )
    # A rank on another node than the coordinator's announces its part in its own node's tier
    # until the part record is durable: that node's cleanup never sees the coordinator's
    # record, and would otherwise take a straggler's data for a failed save's leftovers.
    announced = _announce_part(session, gen, assignment)
    if announced is not None:  # a node that never sees the coordinator's markers learns here
        settle_parts(
            tier,
            list(assignment.settled),
            current=assignment.current,
            ttl=session.config.promote.activity_ttl,
            trust=session.trust,
        )
    try:
        out = files.write(plan.items, planner)
        if session.commit_gate is not None and out.gate is not None:
            reason = session.commit_gate(out.gate)
            if reason:
                raise CommitVetoedError(f"commit gate vetoed checkpoint {ckpt!r} on rank {rank}: {reason}")
        if tier.node_local and assignment.multi_node:
            # Other nodes' promoters never see the coordinator's marker: tell them here.
            record = PartRecord(
                ckpt,
                gen,
                session.node,
                (rank,),
                tuple(out.files),
                assignment.seq,
                assignment.world_size,
                node_ranks=assignment.node_ranks,
                coordinator_host=assignment.coordinator_host,
            )
            files.out.written.append(rank_part_path(ckpt, gen, rank))
            # Every node's log learns the number: whichever node coordinates next continues
            # from it (the coordinator's node may be replaced, or swap places). Its change stamp
            # comes after the part record too: this node's promoter lists both.
            writes = [(rank_part_path(ckpt, gen, rank), record.to_json())]
            record_parts(tier, ckpt, writes, log=LogEntry(assignment.seq, ckpt, gen))
    except BaseException:
        # Invisible without a marker, but leave no garbage; its part record may have been seen.
        listed = tier.node_local and assignment.multi_node
        discard(tier, ckpt, files.out.written, quiet=True, listed=listed)
        raise
    finally:
        if announced is not None:
            announced.release()
    results = [*out.results, WriteResult(MetadataIndex(f"{FILES_KEY}{rank}"), 0, RankFiles(tuple(out.files)))]
    future: Future[list[WriteResult]] = Future()
    future.set_result(results)
    return list(out.files), future


def _announce_part(session: SaveSession, gen: str, assignment: RankAssignment) -> Activity | None:
    """A ``write`` record in this rank's node-local tier while it writes its part of a
    multi-node save, when the coordinator's record (in its own node's tier) cannot cover it."""
    tier = session.tier
    if not (tier.node_local and assignment.multi_node) or session.is_coordinator:
        return None
    return hold(tier, "write", session.checkpoint_id, gen, ttl=session.config.promote.activity_ttl)
