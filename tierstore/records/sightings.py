"""What the promoter last saw in the other tiers, written into each tier it looks after.

A save into tier T asks no other tier (DESIGN.md, "Tiers stand alone"), yet it must know which ids are
committed elsewhere (a save without ``overwrite`` must not give an id a second content) and the highest
commit number anywhere (what it claims must be newer). A restore from T must know whether a slower tier
holds a newer commit of the id. The promoter lists every tier anyway, each pass; it leaves what it saw
in tier L as a *sighting* in every tier T it looks after: ``.tierstore/seen/<L>.json`` in T, holding L's
highest commit number and ``{id: (seq, generation)}`` for every id committed in L. Writers and readers of
T read the sightings in T: one small read, however slow or far L is.

A sighting is as old as the promoter's last look (``seen_at``: when its record was written, read on
the reader's clock from the time the tier stamped, see :func:`read_sightings`): it is rewritten when
what it says changes, and at least every ``promote.interval`` while the promoter runs. Between two
passes a slower tier may change behind it only by a save made straight into it (``tier=``): within
the saving process that commit is known at once (:mod:`tierstore.records.known`); elsewhere after
the promoter's next pass. Restores therefore trust a sighting only while it is fresh (:func:`trusted`,
three promoter intervals and at least 30 s): with no promoter running, the slower tier is asked
again, within ``probe_timeout``. Saves use every sighting, however old: what they add (ids taken, the
highest number) only grows.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tierstore.errors import TierstoreError
from tierstore.ids import SIGHTINGS_DIR, is_checkpoint_id, is_generation, sighting_path
from tierstore.records.clock import clock_offset
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
FORMAT = "tierstore.seen/1"


@dataclass(frozen=True)
class Sighting:
    """What one tier held when the promoter last listed it."""

    tier: str
    """The tier that was looked at."""
    highest: int
    """Its highest commit number (commit log and markers)."""
    ids: Mapping[str, tuple[int | None, str]] = field(default_factory=dict)
    """``{id: (seq, generation)}`` of every copy committed there."""
    seen_at: float = field(default_factory=time.time)

    def is_fresh(self, max_age: float, now: float | None = None) -> bool:
        """True when the sighting is at most ``max_age`` seconds old."""
        return (time.time() if now is None else now) - self.seen_at <= max_age

    def same_as(self, other: Sighting | None) -> bool:
        """True when ``other`` says the same (its time aside): no need to write it again."""
        return (
            other is not None
            and other.tier == self.tier
            and other.highest == self.highest
            and dict(other.ids) == dict(self.ids)
        )

    def to_json(self) -> bytes:
        """Serialize (ids sorted, so equal sightings have equal bytes)."""
        body = {
            "format": FORMAT,
            "tier": self.tier,
            "highest": self.highest,
            "seen_at": self.seen_at,
            "ids": {i: [seq, gen] for i, (seq, gen) in sorted(self.ids.items())},
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Sighting:
        """Parse; ``ValueError`` naming ``where`` if malformed."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict) or body.get("format") != FORMAT:
                raise ValueError(f"expected format {FORMAT!r}")
            ids: dict[str, tuple[int | None, str]] = {}
            for checkpoint_id, (seq, generation) in dict(body["ids"]).items():
                if not is_checkpoint_id(checkpoint_id) or not is_generation(str(generation)):
                    raise ValueError(f"bad entry {checkpoint_id!r}")
                ids[checkpoint_id] = (None if seq is None else int(seq), str(generation))
            return cls(str(body["tier"]), int(body["highest"]), ids, float(body["seen_at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}: malformed sighting ({exc})") from None


def read_sightings(tier: Tier) -> dict[str, Sighting]:
    """``{other tier name: Sighting}`` recorded in ``tier``; a damaged record is skipped (warned).

    Each ``seen_at`` is when its record was written *on this host's clock*: the record's time as
    the tier stamped it, moved by how far this host's clock is from the tier's
    (:func:`~tierstore.records.clock.clock_offset`), not the promoter's clock written inside. So
    freshness, and which of a sighting and this process's own look or commit is newer, never
    depend on how far the promoter's clock is from this one. A reader that cannot write the tier
    (read-only credentials: ``ls``, ``status``) cannot probe its clock and keeps the promoter's
    times: it deletes nothing and saves nothing there.
    """
    found: dict[str, Sighting] = {}
    files = [f for f in tier.find(SIGHTINGS_DIR) if f.path.endswith(".json")]
    offset: float | None = 0.0
    if files:
        try:
            offset = clock_offset(tier)
        except (TierstoreError, OSError) as exc:
            logger.debug("cannot probe the clock of tier %s (%s): promoter times kept", tier.name, exc)
            offset = None
    for info in files:
        try:
            sighting = Sighting.from_json(tier.read_bytes(info.path), where=f"tier {tier.name}: {info.path}")
        except FileNotFoundError:
            continue
        except ValueError as exc:
            logger.warning("ignoring %s", exc)
            continue
        if offset is not None:
            sighting = replace(sighting, seen_at=info.mtime + offset)
        found[sighting.tier] = sighting
    return found


def trust_period(promote_interval: float) -> float:
    """How long a restore trusts a sighting: three promoter intervals, at least 30 s."""
    return max(3 * promote_interval, 30.0)


def trusted(sightings: dict[str, Sighting], max_age: float) -> dict[str, Sighting]:
    """The sightings fresh enough for a restore to trust (see the module docstring)."""
    now = time.time()
    return {name: s for name, s in sightings.items() if s.is_fresh(max_age, now)}


def record_sighting(
    tier: Tier, sighting: Sighting, known: Sighting | None = None, *, refresh_after: float = 0.0
) -> bool:
    """Leave ``sighting`` in ``tier`` unless ``known`` (what is there) says the same and is younger
    than ``refresh_after`` seconds; True if written."""
    if sighting.same_as(known) and known is not None and known.is_fresh(refresh_after):
        return False
    tier.write_bytes(sighting_path(sighting.tier), sighting.to_json())
    return True
