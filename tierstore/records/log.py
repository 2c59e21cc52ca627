"""The commit log: a monotonic sequence per namespace, the only thing that decides what is newest.

Every commit takes the next sequence number: one more than the highest its writer knows of (its own
tier's log, what the promoter saw elsewhere, what its process read at start-up), claimed create-only
in the target tier (``.tierstore/commits/<seq>~<id>~<generation>``, an empty object), so two writers
cannot take the same number in one tier (:func:`tierstore.records.protocol.claim`). The entry travels
with the copy: a promotion that publishes a marker writes the same entry in its target, a drop deletes
it with the copy. One listing of the directory orders every commit in a tier, without reading a marker.

Why not the step in the id, or a clock: after a rollback (resuming from an older checkpoint after a
loss spike) the new saves must be newer than the abandoned ones although their steps are lower; ids
such as ``final`` or ``step100_20240601`` carry no usable step; clocks of two coordinators disagree.
Why more than the target's own log: the first tier may be wiped (a node replaced), a save may go
straight to a lower tier (``tier=``); the lower tiers still hold their entries, and the writer learns
their highest number from the promoter's sightings or its start-up look, so numbers keep growing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tierstore.ids import COMMITS_DIR, commit_entry_path, parse_commit_entry
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogEntry:
    """One commit: its sequence number, checkpoint id and generation, and the entry's path."""

    seq: int
    checkpoint_id: str
    generation: str

    @property
    def path(self) -> str:
        """Tier-relative path of the entry."""
        return commit_entry_path(self.seq, self.checkpoint_id, self.generation)


def read_log(tier: Tier) -> list[LogEntry]:
    """Every entry in ``tier``'s commit log (one listing), in sequence order."""
    entries = []
    for info in tier.find(COMMITS_DIR):
        parsed = parse_commit_entry(info.path)
        if parsed is not None:
            entries.append(LogEntry(*parsed))
    return sorted(entries, key=lambda e: e.seq)


def highest_in(tier: Tier) -> int:
    """The highest commit number logged in ``tier`` (0 when none): one listing."""
    log = read_log(tier)
    return log[-1].seq if log else 0
