"""Deleting committed copies that retention no longer keeps: one routine for the promoter and ``gc``.

A copy is deleted marker first (from that moment it does not exist: nothing loads, promotes or counts
it), then its part records, then its data. A failure part-way leaves data without a marker, which the
leftover cleanup (:mod:`tierstore.promote.cleanup`) removes later; it never leaves a marker over
missing data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from tierstore.errors import TierstoreError
from tierstore.ids import PARTS_DIR, marker_path
from tierstore.promote.policy import Deletion
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


def delete_copy(tier: Tier, checkpoint_id: str) -> None:
    """Delete one copy: the marker first, then part records, then data."""
    tier.delete(marker_path(checkpoint_id))
    for info in tier.find(checkpoint_id):
        if f"/{PARTS_DIR}/" in info.path:
            tier.delete(info.path)
    tier.delete_tree(checkpoint_id)


def delete_copies(
    tiers: Mapping[str, Tier],
    deletions: Iterable[Deletion],
    *,
    on_deleted: Callable[[Deletion], None] = lambda _d: None,
) -> list[Deletion]:
    """Carry out ``deletions`` one by one; a failure is logged and skips only that copy.

    Returns the deletions done; ``on_deleted`` is told of each (metrics, events).
    """
    done: list[Deletion] = []
    for deletion in deletions:
        try:
            delete_copy(tiers[deletion.tier], deletion.checkpoint_id)
        except (TierstoreError, OSError) as exc:
            logger.error(
                "deleting %s from %s failed: %s", deletion.checkpoint_id, deletion.tier, exc
            )
            continue
        on_deleted(deletion)
        done.append(deletion)
    return done
