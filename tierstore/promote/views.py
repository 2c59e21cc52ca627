"""A promoter's last listing of each tier, reused while the tier's change stamp says nothing changed.

A pass needs, of every tier, its committed copies (markers), the highest number in its commit log, its
conflict records and, in node-local tiers, this node's part records. Listing them costs pages of LIST
requests (S3) or a ``stat`` per generation (disks) that grow with the checkpoints kept. Every
tierstore actor rewrites the tier's change stamp *after* each change to those
(:mod:`tierstore.records.changes`), so a promoter reads the stamp first, one GET or one open, and
when it is the token it read before its previous listing, that listing is still what a listing made
just before any change still unstamped would show: a snapshot of the past, as every listing is by the
time a pass acts on it (the proof is in :mod:`tierstore.records.changes`).

How long a change can go unseen:

* made by a tierstore actor that stamped it: until the promoter's next pass (``promote.interval``);
* made behind tierstore's back (``aws s3 rm``, a lifecycle rule, an older release) or by an actor
  killed between its change and its stamp: until the promoter's next full listing, at most
  ``promote.full_scan`` after its previous one (a restarted promoter stamps every tier at the end of
  its first pass: what its predecessor left unstamped is then seen at every promoter's next pass).

Nothing destructive trusts a reused listing: retention deletes only by a listing made in the same
pass (a pass with deletions to make looks at every tier again first, ``full``: it lists each, or
reads the stamp of a job-wide tier another node keeps and then its keeper's index made under that
very stamp, which is as fresh as a listing made after that read and so no reused listing); the
protocol's drop and publish read the marker they act on again; cleanup lists afresh
and takes a marker from the cache only at the mtime it lists
(:func:`~tierstore.promote.cleanup.find_leftovers`); a promotion reads the target's marker before
copying and publishes create-only, and one that fails forgets the listings of its two tiers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tierstore.promote.discovery import SeenCopy
from tierstore.records.conflicts import Conflict
from tierstore.records.parts import PartRecord


@dataclass(frozen=True)
class TierView:
    """One tier as a promoter last listed it, and the stamp it read just before."""

    token: bytes | None
    """The tier's change stamp read before the listing (None: the tier had none)."""
    listed_at: float
    """When the stamp was read (this process's monotonic clock)."""
    found: dict[str, SeenCopy]
    highest: int
    conflicts: tuple[Conflict, ...]
    parts: dict[str, dict[str, list[PartRecord]]] = field(default_factory=dict)
    """In a node-local tier, this node's parts of saves coordinated elsewhere
    (:func:`~tierstore.promote.discovery.foreign_parts`)."""


class TierViews:
    """The last full listing of each tier (see the module docstring), reused while the tier's
    stamp holds the same token and the listing is younger than ``full_scan`` seconds (0: never)."""

    def __init__(self, full_scan: float) -> None:
        self.full_scan = full_scan
        self._views: dict[str, TierView] = {}

    def reusable(self, tier_name: str, token: bytes | None) -> TierView | None:
        """The listing kept of ``tier_name`` if the stamp just read (``token``) is the one read
        before it and a full listing is not due; else None."""
        view = self._views.get(tier_name)
        if view is None or view.token != token or time.monotonic() - view.listed_at >= self.full_scan:
            return None
        return view

    def behind(self, tier_name: str) -> TierView | None:
        """The listing kept of ``tier_name`` though its stamp moved on, while a full listing is not
        due; else None. For a tier another promoter keeps, until its index shows the change
        (:mod:`tierstore.records.index`), whose token is checked against the stamp again at the next look."""
        view = self._views.get(tier_name)
        return None if view is None or time.monotonic() - view.listed_at >= self.full_scan else view

    def keep(self, tier_name: str, view: TierView) -> None:
        """Keep ``view`` as the tier's listing (made after reading ``view.token``)."""
        self._views[tier_name] = view

    def forget(self, tier_name: str) -> None:
        """List ``tier_name`` again at the next look (a failed promotion, parts just rewritten)."""
        self._views.pop(tier_name, None)

    def age(self, tier_name: str) -> float | None:
        """Seconds since the kept listing of ``tier_name`` was started; None without one."""
        view = self._views.get(tier_name)
        return None if view is None else time.monotonic() - view.listed_at
