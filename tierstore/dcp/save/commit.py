"""The coordinator's commit (DCP step 4): DCP's ``.metadata``, then the signed marker **last**,
with the commit number that places it in commit order. A save that fails here leaves no marker
(or, if its publish happened after all, is committed): the peer mirror and the metrics hear which.

And what a save knows of commits already made (the target's marker, the other tiers: see
:mod:`tierstore.records.known`): an id committed in any tier is refused unless the writer overwrites.
"""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from tierstore._platform.killpoints import kill_point
from tierstore.checksum import crc32c, sha256_hex
from tierstore.dcp.save.mirror_handoff import tell_mirror
from tierstore.dcp.save.session import RankFiles, SaveSession
from tierstore.errors import CheckpointExistsError, TierstoreError
from tierstore.ids import checkpoint_file, marker_path, metadata_file
from tierstore.records.known import Elsewhere
from tierstore.records.marker import FileEntry, Manifest, read_manifest, signed
from tierstore.records.protocol import drop, publish, renumber
from tierstore.records.sightings import Sighting, read_sightings
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


def finish(session: SaveSession, metadata: Metadata, results: list[list[WriteResult]]) -> None:
    """Coordinator: write ``.metadata``, re-check every file, then publish the marker last.

    Raises:
        CheckpointExistsError: the id was committed by another writer meanwhile (this save is
            dropped), or is committed elsewhere and the writer does not overwrite.
        TierstoreError: ``finish`` without a planned save.
    """
    ckpt, gen = session.checkpoint_id, session.generation
    if gen is None:
        raise TierstoreError("finish() called without a planned save")
    mirror, session.round = session.round, None
    try:
        manifest = _commit(session, gen, metadata, results)
    except BaseException as exc:
        landed = published(session.tier, ckpt, gen, session.trust)
        session.stop_writing(committed=landed is not None)
        if mirror is not None:
            tell_mirror(mirror, landed, exc)
        _record_commit(session, landed)
        raise
    kill_point("writer.committed")
    session.stop_writing(committed=True)
    if mirror is not None:
        tell_mirror(mirror, manifest, None)
    _record_commit(session, manifest)


def _record_commit(session: SaveSession, manifest: Manifest | None) -> None:
    """Metrics: the coordinator committed the save (``manifest``), or it failed (None)."""
    if manifest is None:
        session.metrics.failed(session.rank, session.tier_name)
    else:
        commit_s = float(manifest.timings.get("commit_s") or 0.0)
        session.metrics.committed(session.rank, session.tier_name, commit_s=commit_s)


def _commit(session: SaveSession, gen: str, metadata: Metadata, results: list[list[WriteResult]]) -> Manifest:
    tier, ckpt = session.tier, session.checkpoint_id
    files: list[FileEntry] = []
    storage: dict[MetadataIndex, Any] = {}
    for rank_results in results:
        for result in rank_results:
            if isinstance(result.storage_data, RankFiles):
                files.extend(result.storage_data.files)
            else:
                storage[result.index] = result.storage_data
    metadata.storage_data = storage
    metadata.storage_meta = StorageMeta(checkpoint_id=ckpt, save_id=uuid.uuid4().hex)
    blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    meta_rel = metadata_file(gen)
    tier.write_bytes(checkpoint_file(ckpt, meta_rel), blob)
    kill_point("writer.metadata_written")
    keys = session.trust.keys
    digest = sha256_hex(blob) if keys is not None else None
    files.append(FileEntry(meta_rel, len(blob), crc32c(blob), None, session.node, digest))
    sightings = read_sightings(tier)
    elsewhere = session.look_elsewhere(True)
    manifest = Manifest(
        checkpoint_id=ckpt,
        generation=gen,
        world_size=len(results),
        files=tuple(sorted(files, key=lambda f: f.path)),
        timings=_timings(session, time.time()),
        topology=_topology(session),
        seq=_seq_at_commit(session, gen, elsewhere.highest_known(tier.name, sightings)),
        overwrite=session.overwrite,
        unseen_tiers=tuple(elsewhere.unseen(tier.name, sightings)),
        namespace=session.config.namespace or "",
    )
    manifest = signed(manifest, keys)  # last: the signature covers every field above
    ttl, trust, replace = session.config.promote.activity_ttl, session.trust, session.overwrite
    try:
        if not replace:  # one id, one content: again, just before
            refuse_committed_id(tier, elsewhere, ckpt, sightings)
        replaced = marker(tier, ckpt, trust) if replace else None
        existing = publish(
            tier, manifest, trust=trust, replace=replace, node=session.node, log=False, ttl=ttl
        )
        if existing is not None:
            raise CheckpointExistsError(
                f"checkpoint {ckpt!r} was committed in tier {tier.describe()} by another"
                " writer while this save was running; this save was discarded"
            )
    except CheckpointExistsError:
        session.stop_writing()  # this save's own record would keep its files
        try:  # gc removes what is left
            drop(tier, ckpt, gen, trust=trust, committed=False, ttl=ttl)
        except Exception as cleanup:  # noqa: BLE001 - best effort
            logger.warning("cleanup failed: %s", cleanup)
        raise
    elsewhere.committed(tier.name, ckpt, manifest.seq or 0, gen)
    if replaced is not None and replaced.generation != gen:  # dropped: so are its parts
        elsewhere.failed(tier.name, ckpt, replaced.generation)  # elsewhere, next plan
    logger.info("committed %s in tier %s (%d bytes)", ckpt, tier.name, manifest.total_bytes)
    return manifest


def _seq_at_commit(session: SaveSession, gen: str, known: int) -> int:
    """The sequence number the marker carries: the one claimed when the save was planned,
    unless another save has taken a higher one since in this tier, or a higher one became known
    elsewhere (a save that started later but committed first, a zombie job's late overwrite):
    then a new one, so that commit order is the order in which commits happened. A multi-node
    save too: the other nodes' part records keep the number claimed at planning until it is
    confirmed (its mirror exchange, this coordinator's next plan, or the promoter reading the
    job-wide tier: design.md, rule 2)."""
    session.seq = renumber(session.tier, session.checkpoint_id, gen, claimed=session.seq, known=known)
    return session.seq


def _topology(session: SaveSession) -> dict[str, Any] | None:
    """The saving job's nodes and hosts, recorded when the tier mirrors (placement input)."""
    if (mirror := session.mirror) is None:
        return None
    hosts = {str(r.node): r.host for r in session.reports}
    return {"hosts": hosts, "mirror_stride": mirror.stride}


def _timings(session: SaveSession, committed_at: float) -> dict[str, float | None]:
    """The save's start, the trainer's longest stall and back-pressure wait, and its commit time."""
    reports = session.reports
    started = min((r.started_at for r in reports), default=session.started_at)
    stalls = [r.stall_s for r in reports if r.stall_s is not None]
    waits = [r.wait_s for r in reports if r.wait_s is not None]
    return {
        "started_at": started,
        "stall_s": max(stalls) if stalls else committed_at - started,
        "wait_s": max(waits) if waits else None,
        "commit_s": committed_at - started,
    }


def refuse_committed_id(
    tier: Tier, elsewhere: Elsewhere, checkpoint_id: str, sightings: dict[str, Sighting]
) -> None:
    """An id committed in *any* tier is taken: saving it again without ``overwrite`` would let
    two different contents carry one id. The target tier is asked; the others are known from
    start-up, the promoter's sightings and this process's commits, never asked.

    Raises:
        CheckpointExistsError: naming the tier that holds the id.
    """
    holder = tier.name if tier.exists(marker_path(checkpoint_id)) else None
    holder = holder or elsewhere.holder(checkpoint_id, besides=tier.name, sightings=sightings)
    if holder is not None:
        raise CheckpointExistsError(
            f"checkpoint {checkpoint_id!r} is already committed in tier {holder}; pass"
            " overwrite=True to TieredWriter to replace it"
        )


def marker(tier: Tier, checkpoint_id: str, trust: MarkerTrust) -> Manifest | None:
    """The id's marker in the target now; None when there is none (or none readable)."""
    try:
        return read_manifest(tier, checkpoint_id, trust=trust)
    except Exception:  # noqa: BLE001 - no marker, or none readable: no commit to speak of
        return None


def current_commit(tier: Tier, checkpoint_id: str, trust: MarkerTrust) -> tuple[str, str, int | None]:
    """``(id, generation, seq)`` of the id's marker in the target ('' and None: none)."""
    found = marker(tier, checkpoint_id, trust)
    return (checkpoint_id, "", None) if found is None else (checkpoint_id, found.generation, found.seq)


def published(tier: Tier, checkpoint_id: str, generation: str, trust: MarkerTrust) -> Manifest | None:
    """The marker naming this save's generation, if its publish happened after all (a publish
    can fail after its rename); None: the save did not commit."""
    found = marker(tier, checkpoint_id, trust)
    return found if found is not None and found.generation == generation else None
