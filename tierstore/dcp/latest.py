"""``latest_committed``: the checkpoint a restarting job should restore, the same on every rank.

"Latest" means the newest checkpoint **this job can restore**: one with a usable committed copy for
every rank, in one tier, checked the way a restore checks it (:mod:`tierstore.dcp.restore_choice`).
A checkpoint held only in node-local tiers of several nodes is not restorable by a multi-node job
(without peer transfer a rank cannot read another node's memory or disk), so the answer is then the
newest one complete in a job-wide tier (shared, S3), and a restart recipe built on it never fails.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from tierstore.catalog import Catalog
from tierstore.config import Config, as_config
from tierstore.dcp.collectives import broadcast_object, rank_and_world
from tierstore.dcp.restore_choice import choose_copy
from tierstore.errors import CheckpointNotFoundError, TierstoreError
from tierstore.topology import current_node, is_distributed

logger = logging.getLogger(__name__)
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
    """
    config = as_config(config)
    distributed = collective and is_distributed()
    group = process_group if distributed else None
    rank, _ = rank_and_world(group) if distributed else (0, 1)
    this_node = current_node(node)
    tiers = config.make_tiers(node=this_node)
    skipped: list[str] = []
    candidates = Catalog(config, node=this_node).candidates() if rank == 0 else iter(())
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
            return None
        for checkpoint_id in ids:
            try:
                choose_copy(tiers, checkpoint_id, node=this_node, verify=False, group=group,
                            collective=distributed)  # fmt: skip
            except CheckpointNotFoundError as exc:  # the same verdict on every rank
                skipped.append(checkpoint_id)
                logger.info("latest: %s is not restorable by this job: %s", checkpoint_id, exc)
                continue
            if skipped and rank == 0:
                logger.warning("latest restorable checkpoint is %s; newer but not restorable by"
                               " this job: %s", checkpoint_id, ", ".join(skipped))  # fmt: skip
            return checkpoint_id
