"""Conflict records: a copy the promoter kept beside another content of its id in a lower tier.

Two contents under one id happen when a save could not know of the other: it ran while the other tier
was unreachable at start-up (its marker names the tier in ``unseen_tiers``), or it raced a save of the
same id into another tier. Promotion never settles that by guessing: the target keeps its copy, the
source keeps its own, and the source tier holds a record
``.tierstore/conflicts/<id>~<generation>~<target>.json`` naming both. While it exists, retention keeps
the source copy and promotion does not retry it; ``tierstore ls`` and the promoter's metrics show it.
An operator settles it by keeping one content (``tierstore drop ID --tier NAME`` on the other, or a
save with ``overwrite=True`` made while both tiers are seen); cleanup then removes the record, whose
source generation is no longer committed.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

from tierstore.ids import CONFLICTS_DIR, conflict_path, parse_conflict_path
from tierstore.records.changes import touch
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
FORMAT = "tierstore.conflict/1"


@dataclass(frozen=True)
class Conflict:
    """One copy (``checkpoint_id``, ``generation``) kept beside another content in ``target``."""

    checkpoint_id: str
    generation: str
    seq: int | None
    target: str
    target_generation: str
    target_seq: int | None
    why: str
    detected_at: float = field(default_factory=time.time)

    @property
    def path(self) -> str:
        """Tier-relative path of the record (in the source tier)."""
        return conflict_path(self.checkpoint_id, self.generation, self.target)

    def describe(self) -> str:
        """One line for logs and ``ls``."""
        return (
            f"{self.checkpoint_id}: generation {self.generation} (commit {self.seq}) kept here;"
            f" tier {self.target} holds generation {self.target_generation} (commit"
            f" {self.target_seq}): {self.why}"
        )


def record_conflict(tier: Tier, conflict: Conflict) -> bool:
    """Leave the record in ``tier`` (the source), then stamp it (records/changes.py); True if it
    is new."""
    if tier.exists(conflict.path):
        return False
    try:
        tier.write_bytes(conflict.path, json.dumps({"format": FORMAT, **asdict(conflict)}).encode())
    finally:
        touch(tier)
    return True


def read_conflicts(tier: Tier) -> list[Conflict]:
    """Every conflict record in ``tier``; a damaged one is skipped with a warning."""
    found: list[Conflict] = []
    for info in tier.find(CONFLICTS_DIR):
        if parse_conflict_path(info.path) is None:
            continue
        try:
            body = json.loads(tier.read_bytes(info.path))
            if body.pop("format", None) != FORMAT:
                raise ValueError(f"expected format {FORMAT!r}")
            found.append(Conflict(**body))
        except FileNotFoundError:
            continue
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring conflict record %s in %s: %s", info.path, tier.name, exc)
    return found


def clear_conflict(tier: Tier, conflict: Conflict) -> None:
    """Remove a record whose conflict is settled, then stamp the tier (records/changes.py)."""
    try:
        tier.delete(conflict.path)
    finally:
        touch(tier)
