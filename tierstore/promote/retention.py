"""Deleting a committed copy that retention no longer keeps: one routine for the promoter and ``gc``.

A copy is deleted marker first (from that moment it does not exist: nothing loads, promotes or counts
it), then its generation: part records, then data. Only the generation the marker named: another
generation of the id may be an overwrite in flight, which cleanup judges by its activity record. A
failure part-way leaves data without a marker, which the leftover cleanup
(:mod:`tierstore.promote.cleanup`) removes later; it never leaves a marker over missing data.
"""

from __future__ import annotations

import logging

from tierstore.errors import IntegrityError
from tierstore.records.activity import ACTIVITY_TTL
from tierstore.records.marker import read_manifest
from tierstore.records.protocol import drop
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


def delete_copy(
    tier: Tier,
    checkpoint_id: str,
    generation: str | None = None,
    *,
    trust: MarkerTrust,
    ttl: float = ACTIVITY_TTL,
) -> None:
    """Delete one copy through the protocol's drop: the marker first (only if it still names
    ``generation``: an overwrite committed since is left alone), then its log entries, part records
    and, unless a restore is reading it, its data (:func:`tierstore.records.protocol.drop`).

    ``generation`` names the copy retention decided on (default: the one the marker names now).
    """
    if not generation:
        try:
            generation = read_manifest(tier, checkpoint_id, trust=trust).generation
        except (FileNotFoundError, IntegrityError):
            return  # nothing committed, or a marker only cleanup may judge
    drop(tier, checkpoint_id, generation, trust=trust, ttl=ttl)
