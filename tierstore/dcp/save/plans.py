"""The plans a save exchanges between ranks (DCP steps 1-2).

Each rank reports its node, timings and the highest commit number its node knows
(:class:`RankReport`, in its local plan); the coordinator chooses the save's fresh generation and
claims its commit number, then tells every rank its part (:class:`RankAssignment`, in the global
plan).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan

from tierstore.dcp.save.commit import current_commit, refuse_committed_id
from tierstore.dcp.save.mirror_handoff import open_groups
from tierstore.dcp.save.session import RankAssignment, RankReport, SaveSession
from tierstore.errors import TierstoreError
from tierstore.ids import new_generation
from tierstore.records.log import highest_in
from tierstore.records.mirror import mirrored_ids
from tierstore.records.protocol import claim
from tierstore.records.sightings import read_sightings
from tierstore.topology import current_host


def check_set_up(checkpoint_id: str | None, kwargs: dict[str, Any]) -> tuple[str, int]:
    """Every rank, step 1, before the save's session: the save's id and this rank; raises
    :class:`TierstoreError` with ``use_collectives=False`` in a multi-rank job, or no checkpoint id."""
    rank = int(kwargs.get("rank", dist.get_rank() if dist.is_initialized() else 0))
    collectives = kwargs.get("use_collectives", True)
    if collectives is False and dist.is_initialized() and dist.get_world_size() > 1:
        raise TierstoreError("TieredWriter needs use_collectives=True (one commit marker)")
    if checkpoint_id is None:
        raise TierstoreError(
            "no checkpoint id: pass checkpoint_id= to dcp.save/async_save or to TieredWriter"
        )
    return checkpoint_id, rank


def set_up(session: SaveSession) -> None:
    """Every rank, step 1: the job's groups, the process's look at the other tiers; the
    coordinator refuses an already committed id unless overwriting.

    Raises:
        CheckpointExistsError: the id is committed in some tier and the writer does not overwrite.
    """
    open_groups(session.mirror)
    elsewhere = session.look_elsewhere(session.is_coordinator)
    if session.is_coordinator and not session.overwrite:
        refuse_committed_id(session.tier, elsewhere, session.checkpoint_id, read_sightings(session.tier))


def local_plan(session: SaveSession, plan: SavePlan, staged: RankReport | None) -> SavePlan:
    """Every rank, step 2: attach this rank's report (node, host, timings, highest number);
    ``staged``: the report of the stage that copied this save's state, if it was staged."""
    report = staged or RankReport(node=session.node, started_at=session.started_at)
    report = dataclasses.replace(report, host=current_host(), highest_seq=_node_highest(session))
    session.metrics.staged(report.stall_s, report.wait_s)
    return dataclasses.replace(plan, storage_data=report)


def _node_highest(session: SaveSession) -> int:
    """The highest commit number this rank's node knows: its target tier's log, the promoter's
    sightings there, the process's start-up look, the node's mirrored commits."""
    tier = session.tier
    sightings = read_sightings(tier)
    known = session.look_elsewhere(False).highest_known(tier.name, sightings)
    found = [highest_in(tier, above=known)]
    if session.mirror is not None:
        found += [seq or 0 for seq in mirrored_ids(tier).values()]
    return max(found)


def global_plan(session: SaveSession, plans: list[SavePlan]) -> list[SavePlan]:
    """Coordinator, step 2: choose this save's generation, claim its commit number and tell every
    rank its part."""
    ckpt, tier = session.checkpoint_id, session.tier
    gen = session.generation = new_generation()
    # Announced before any rank writes: cleanup leaves an in-flight generation alone, however
    # invisible its parts (temp files, multipart uploads, a straggler rank) or old its files.
    session.start_writing()
    # The commit's place in commit order (what "newest" means): the next number after the
    # highest any tier has logged, claimed create-only in the target.
    reports = session.reports = [p.storage_data for p in plans if isinstance(p.storage_data, RankReport)]
    floor = max((r.highest_seq for r in reports), default=0)
    seq = session.seq = claim(tier, ckpt, gen, floor=floor)
    multi_node = len({r.node for r in reports}) > 1
    nodes = [r.node for r in reports]
    settled = tuple(session.look_elsewhere(True).outcomes(tier.name)) if multi_node else ()
    current = current_commit(tier, ckpt, session.trust) if multi_node else None
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
