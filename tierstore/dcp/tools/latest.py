"""``latest_committed``: the checkpoint a restarting job should restore, the same on every rank.

"Latest" means the newest checkpoint **this job can restore**: one with a usable committed copy for
every rank, in one tier, checked the way a restore checks it (:mod:`tierstore.dcp.restore.choice`).
A checkpoint held only in node-local tiers of several nodes is not restorable by a multi-node job
(without peer transfer a rank cannot read another node's memory or disk), so the answer is then the
newest one complete in a job-wide tier (shared, S3), and a restart recipe built on it never fails.
With a mirrored memory tier, every node also says which ids it holds (own or mirrored), and a
memory-tier copy counts when every saved rank's files are held verified on some node of this job.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import torch.distributed as dist

from tierstore._platform.bounded import Prober
from tierstore.config import Config, as_config
from tierstore.dcp.collectives import all_gather_object, broadcast_object, rank_and_world
from tierstore.dcp.restore import choose_copy
from tierstore.errors import CheckpointNotFoundError, TierstoreError, one_line
from tierstore.records.catalog import Catalog, marker_times
from tierstore.records.marker import read_manifest
from tierstore.records.mirror import mirrored_ids
from tierstore.records.sightings import trust_period
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier
from tierstore.topology import current_node, is_distributed

logger = logging.getLogger("tierstore.dcp.latest")  # the name users configure (see docs/usage.md)
_BATCH = 8
"""Candidates rank 0 lists per round: the first is nearly always restorable."""


def latest_committed(
    config: Config | str | os.PathLike[str],
    *,
    node: int | None = None,
    collective: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> str | None:
    """The newest checkpoint id this job can restore (see the module docstring), or None.

    With torch.distributed initialised and ``collective=True`` this is a collective: call it on
    every rank. Rank 0 lists the committed ids newest first; for each, every rank checks its own
    share of the candidate copies and the ranks agree, so every rank returns the same id. With
    ``collective=False`` (or without distributed) it is the newest checkpoint this process alone can
    restore. Raises :class:`~tierstore.errors.TierstoreError` on every rank when rank 0 cannot list.

    Rank 0 logs the answer at INFO (the id and the tier it would restore from, or that there is
    none, naming the tiers that could not be listed), and at WARNING the newer ids it passed over.
    """
    started = time.monotonic()
    config = as_config(config)
    distributed = collective and is_distributed()
    group = process_group if distributed else None
    rank, _ = rank_and_world(group) if distributed else (0, 1)
    this_node = current_node(node)
    tiers = config.make_tiers(node=this_node)
    prober = Prober(config.probe_timeout)
    skipped: list[str] = []
    mirrored = [t for t in tiers if t.name == config.mirrored]
    catalog = Catalog(config, node=this_node, tiers=tiers)
    if mirrored:  # also alone: a surviving node's mirrors may hold the newest checkpoint
        candidates = _with_peer_candidates(catalog, mirrored, group, rank, distributed)
    else:
        candidates = catalog.candidates() if rank == 0 else iter(())
    while True:
        batch: tuple[list[str], str | None] = ([], None)
        if rank == 0:
            try:
                batch = ([c for _, c in zip(range(_BATCH), candidates, strict=False)], None)
            except Exception as exc:  # noqa: BLE001 - every rank must leave the collective
                batch = ([], f"{type(exc).__name__}: {exc}")
        ids, error = broadcast_object(batch, group) if distributed else batch
        if error is not None:
            raise TierstoreError(f"finding the latest checkpoint failed on rank 0: {error}")
        if not ids:
            if rank == 0:
                _log_none(tiers, catalog.unreachable, skipped, time.monotonic() - started)
            return None
        for checkpoint_id in ids:
            try:
                choice = choose_copy(
                    tiers,
                    checkpoint_id,
                    trust=catalog.trust,
                    mirrored=config.mirrored,
                    node=this_node,
                    verify=False,
                    group=group,
                    collective=distributed,
                    prober=prober,
                    sighting_trust=trust_period(config.promote.interval),
                )
            except CheckpointNotFoundError as exc:  # the same verdict on every rank
                skipped.append(checkpoint_id)
                if rank == 0:
                    logger.info(
                        "latest: %s is not restorable by this job: %s", checkpoint_id, one_line(str(exc))
                    )
                continue
            if skipped and rank == 0:
                logger.warning(
                    "latest restorable checkpoint is %s; newer but not restorable by this job: %s",
                    checkpoint_id,
                    ", ".join(skipped),
                )
            if rank == 0:
                away = _unreachable(catalog.unreachable)
                logger.info(
                    "latest committed checkpoint: %s, restorable from tier %s (found in %.2f s)%s",
                    checkpoint_id,
                    tiers[choice.tier_index].name,
                    time.monotonic() - started,
                    away,
                )
            return checkpoint_id


def _unreachable(unreachable: dict[str, str]) -> str:
    """``; tiers not reachable, not searched: s3 (why)`` for a log line, or ``""``."""
    if not unreachable:
        return ""
    named = ", ".join(f"{name} ({one_line(why)})" for name, why in sorted(unreachable.items()))
    return f"; not reachable, not searched: {named}"


def _log_none(tiers: list[Tier], unreachable: dict[str, str], skipped: list[str], seconds: float) -> None:
    """Rank 0's line when no checkpoint is restorable: the caller starts fresh."""
    passed = f"; committed but not restorable by this job: {', '.join(skipped)}" if skipped else ""
    logger.info(
        "no committed checkpoint this job can restore in tiers %s (looked in %.2f s)%s%s",
        ", ".join(t.name for t in tiers),
        seconds,
        passed,
        _unreachable(unreachable),
    )


def _node_ids(tiers: list[Tier], trust: MarkerTrust) -> dict[str, int | None]:
    """``{id: commit sequence}`` of what this node's mirrored tiers hold: own markers, mirrors."""
    found: dict[str, int | None] = {}
    for tier in tiers:
        held = mirrored_ids(tier)
        for checkpoint_id in marker_times(tier):
            try:
                held[checkpoint_id] = read_manifest(tier, checkpoint_id, trust=trust).seq
            except Exception:  # noqa: BLE001, S112 - a bad marker is judged by the restore check
                continue
        for checkpoint_id, seq in held.items():
            known = found.get(checkpoint_id)
            found[checkpoint_id] = seq if known is None else max(known, seq or 0)
    return found


def _with_peer_candidates(
    catalog: Catalog, mirrored: list[Tier], group: dist.ProcessGroup | None, rank: int, collective: bool
) -> Iterator[str]:
    """Rank 0's candidates merged with what every node holds in mirrored memory tiers: the
    coordinator's node (and with it the only own marker) may be the one that was lost."""
    try:
        local: dict[str, int | None] | str = _node_ids(mirrored, catalog.trust)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the collective
        local = f"{type(exc).__name__}: {exc}"
    gathered = all_gather_object(local, group) if collective else [local]
    if rank != 0:
        return iter(())
    elsewhere: dict[str, int | None] = {}
    for held in gathered:
        if isinstance(held, str):
            logger.warning("latest: a node's memory tier could not be listed: %s", held)
            continue
        for checkpoint_id, seq in held.items():
            known = elsewhere.get(checkpoint_id)
            elsewhere[checkpoint_id] = seq if known is None else max(known, seq or 0)
    return catalog.candidates(also=elsewhere)
