"""The commit log: a monotonic sequence per namespace, the only thing that decides what is newest.

Every commit takes the next sequence number: one more than the highest in any tier this process can
see, claimed create-only in the target tier (``.tierstore/commits/<seq>~<id>~<generation>``, an empty
object), so two writers cannot take the same number in one tier. The entry travels with the copy: a
promotion that publishes a marker writes the same entry in its target, retention deletes it with the
copy. One listing of the directory orders every commit in a tier, without reading a marker.

Why not the step in the id, or a clock: after a rollback (resuming from an older checkpoint after a
loss spike) the new saves must be newer than the abandoned ones although their steps are lower; ids
such as ``final`` or ``step100_20240601`` carry no usable step; clocks of two coordinators disagree.
Why every tier: the first tier may be wiped (a node replaced), a save may go straight to a lower tier
(``tier=``); the lower tiers still hold their entries, so numbers keep growing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from tierstore.ids import COMMITS_DIR, commit_entry_path, parse_commit_entry
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
_CLAIM_ATTEMPTS = 64


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


def highest(tiers: Iterable[Tier]) -> int:
    """The highest sequence number logged in any of ``tiers`` (0 when none)."""
    return max((e.seq for tier in tiers for e in read_log(tier)), default=0)


def claim(
    target: Tier, tiers: Iterable[Tier], checkpoint_id: str, generation: str, *, floor: int = 0
) -> int:
    """Take the next sequence number for a commit of ``checkpoint_id``/``generation`` in ``target``.

    ``tiers`` are all the tiers to learn the current highest number from (``target`` among them);
    ``floor`` is the highest number known elsewhere (other nodes' node-local tiers, told by their
    ranks). Raises ``RuntimeError`` if the numbers keep being taken by others (64 attempts).
    """
    seq = max(highest(tiers), floor)
    for _attempt in range(_CLAIM_ATTEMPTS):
        seq += 1
        try:
            target.publish(commit_entry_path(seq, checkpoint_id, generation), b"", create_only=True)
        except FileExistsError:
            continue  # another writer took it a moment ago: the next one
        return seq
    raise RuntimeError(f"tier {target.describe()}: no free commit sequence number after {seq}")


def record(target: Tier, entry: LogEntry) -> None:
    """Log ``entry`` in ``target`` (a promotion carrying its copy's sequence down the tiers)."""
    target.publish(entry.path, b"", create_only=False)


def forget(
    tier: Tier, checkpoint_id: str, generation: str, log: list[LogEntry] | None = None
) -> None:
    """Delete the entries of ``checkpoint_id``/``generation`` from ``tier``'s log."""
    for entry in read_log(tier) if log is None else log:
        if entry.checkpoint_id == checkpoint_id and entry.generation == generation:
            tier.delete(entry.path)
