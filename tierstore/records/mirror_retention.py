"""Retention of the peer mirrors a node holds: which go (pure), each retired by the protocol's
:func:`~tierstore.records.protocol.drop_mirror` (marker first, files once nothing needs them)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tierstore.ids import MIRROR_DIR, is_checkpoint_id
from tierstore.records.activity import ACTIVITY_TTL, ActivityInfo, is_busy
from tierstore.records.mirror import MirrorMarker, Recycle, held_mirrors
from tierstore.records.protocol import drop_mirror
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


def remove_mirror(
    tier: Tier,
    checkpoint_id: str,
    generation: str,
    owner_node: int,
    *,
    recycle: Recycle | None = None,
    ttl: float = ACTIVITY_TTL,
) -> None:
    """Delete one mirror: its marker first (it stops counting), then its generation's files when
    no other owner's mirror of that generation remains. ``recycle`` is offered each of those
    files first, once no marker names them; what it does not take is deleted.

    A restore writes its ``read`` record before it looks for markers; so the records are looked
    at again once the marker is gone (``ttl``: theirs): a restore that may have seen the marker
    and chosen this copy keeps the files, left for gc once stale. A snapshot of the readers taken
    before the delete cannot tell (the restore may announce itself in between)."""
    kept = drop_mirror(tier, checkpoint_id, generation, owner_node, recycle=recycle, ttl=ttl)
    if kept == "a restore is reading it":
        logger.info(
            "mirror %s/%s dropped; its files are left to the restore reading them", checkpoint_id, generation
        )


def prune_mirrors(
    tier: Tier,
    keep: int | None,
    *,
    readers: Sequence[ActivityInfo] = (),
    recycle: Recycle | None = None,
    ttl: float = ACTIVITY_TTL,
) -> list[str]:
    """Retention of the mirrors this node holds (every owner's): ``keep`` as the memory tier's.

    A mirror of an older generation of an id whose newer generation is mirrored here is stale (an
    overwrite replaced it) and goes; of the rest, only the ``keep`` newest ids (commit order) stay,
    whichever node owns them (a node that left the job leaves none behind). Called by a holder right
    after it wrote a new mirror marker and by the promoter's retention, so the previous mirror goes
    only once the next one is complete (double-buffered). Ids a live restore is reading (``readers``)
    are left alone, and so are the files of one a restore began reading since (see
    :func:`remove_mirror`; ``ttl``: the ``read`` records'). ``recycle``: see :func:`remove_mirror`.
    Returns ``id/generation`` of each mirror removed.
    """
    held: list[MirrorMarker] = []
    for checkpoint_id in tier.list_dir(MIRROR_DIR):
        if is_checkpoint_id(checkpoint_id):
            held += held_mirrors(tier, checkpoint_id)
    newest: dict[str, tuple[int, str]] = {}
    for marker in held:
        order = (marker.seq or 0, marker.generation)
        newest[marker.checkpoint_id] = max(newest.get(marker.checkpoint_id, order), order)
    ranked = sorted(newest, key=lambda i: newest[i], reverse=True)
    kept = set(ranked if keep is None else ranked[:keep])
    removed: list[str] = []
    for marker in held:
        stale = (marker.seq or 0, marker.generation) < newest[marker.checkpoint_id]
        if (stale or marker.checkpoint_id not in kept) and not is_busy(
            list(readers), marker.checkpoint_id, None
        ):
            remove_mirror(
                tier, marker.checkpoint_id, marker.generation, marker.owner_node, recycle=recycle, ttl=ttl
            )
            removed.append(f"{marker.checkpoint_id}/{marker.generation}")
    return removed
