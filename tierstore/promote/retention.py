"""Deleting committed copies that retention no longer keeps: one routine for the promoter and ``gc``.

A copy is deleted marker first (from that moment it does not exist: nothing loads, promotes or counts
it), then its generation: part records, then data. Only the generation the marker named: another
generation of the id may be an overwrite in flight, which cleanup judges by its activity record. A
failure part-way leaves data without a marker, which the leftover cleanup
(:mod:`tierstore.promote.cleanup`) removes later; it never leaves a marker over missing data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from tierstore.errors import IntegrityError, TierstoreError
from tierstore.ids import PARTS_DIR, generation_dir, marker_path
from tierstore.promote.policy import Deletion
from tierstore.records.activity import is_busy, live
from tierstore.records.log import forget
from tierstore.records.marker import read_manifest
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


def delete_copy(tier: Tier, checkpoint_id: str, generation: str | None = None) -> None:
    """Delete one copy: the marker first, then its generation's part records, then its data.

    ``generation`` names the copy retention decided on (default: the one the marker names). A marker
    naming another generation (an overwrite committed since) is left alone; a part-only copy (a
    node's part, seen through part records) has no marker here. An unreadable marker is deleted
    alone; its data is left to cleanup.
    """
    try:
        committed: str | None = read_manifest(tier, checkpoint_id).generation
    except FileNotFoundError:
        committed = ""
    except IntegrityError:
        committed = None
    generation = generation or committed
    if committed is None or committed == generation:
        tier.delete(marker_path(checkpoint_id))
    if not generation:
        return
    # Asked again now that the marker is gone (no new reader can choose this copy): a restore that
    # chose it before keeps its data; cleanup removes it once that reader is done.
    if is_busy([r for r in live(tier) if r.kind == "read"], checkpoint_id, generation):
        return
    directory = generation_dir(checkpoint_id, generation)
    for info in tier.find(directory):
        if f"/{PARTS_DIR}/" in info.path:
            tier.delete(info.path)
    tier.delete_tree(directory)
    forget(tier, checkpoint_id, generation)
    tier.remove_if_empty(checkpoint_id)  # unless another generation (an overwrite) is there


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
            delete_copy(tiers[deletion.tier], deletion.checkpoint_id, deletion.generation or None)
        except (TierstoreError, OSError) as exc:
            logger.error(
                "deleting %s from %s failed: %s", deletion.checkpoint_id, deletion.tier, exc
            )
            continue
        on_deleted(deletion)
        done.append(deletion)
    return done
