"""The view a pass acts on: one look at every tier, frozen; a duty that changes what the pass holds
hands back a new one (:mod:`tierstore.promote.duties`).

A look reads each tier's change stamp first; while it holds the token read before this promoter's
previous listing of the tier, and that listing is younger than ``promote.full_scan``, the listing is
reused (:mod:`tierstore.promote.views`); ``full`` reuses no listing. A job-wide tier another
promoter keeps is not listed when its stamp moved on: its keeper's index made under that very stamp
is read instead, and while the index is behind, the kept listing is reused until the next pass
(:mod:`tierstore.records.index`); the keeper writes the index after each fresh listing of its tier.
A ``full`` look reads such a tier's stamp and then its index, and takes the index only when it was
made under the stamp just read: as fresh as a listing made after that read, so not a reused
listing (retention may decide on it); with no such index it lists the tier. A keeper's first
listing of its tier under its epoch (start-up, takeover) reads only the markers that its previous
keeper's index does not hold settled at the mtime listed (:meth:`MarkerCache.seed
<tierstore.promote.discovery.MarkerCache.seed>`).
Each tier is asked within ``probe_timeout``. A tier that cannot be listed is left out of the view
and recorded as unreachable (metric, log): nothing is promoted into or out of it, retention deletes
nothing there, and the other tiers go on (tiers stand alone). ``refresh=False`` (the promotion
rounds inside a pass) reuses the conflict records and the highest commit numbers of the look before
where a tier has changed: fewer requests to slow tiers (that listing is not kept).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tierstore._platform.bounded import beat
from tierstore._platform.runtime import map_on_daemons
from tierstore.errors import TierMisconfiguredError, TierstoreError
from tierstore.promote.context import Context
from tierstore.promote.discovery import SeenCopy, discover, foreign_parts, index_of, indexed
from tierstore.promote.policy import Copy, Deletion
from tierstore.promote.views import TierView, TierViews
from tierstore.records.changes import read_stamp
from tierstore.records.conflicts import Conflict, read_conflicts
from tierstore.records.index import read_index, write_index
from tierstore.records.log import highest_taken
from tierstore.records.parts import PartRecord
from tierstore.signing import SigningKeys
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)

Parts = Mapping[str, Mapping[str, Sequence[PartRecord]]]
"""``{id: {generation: part records}}``: this node's parts of saves coordinated elsewhere."""


@dataclass(frozen=True)
class View:
    """What one look saw, per tier that answered, and what it could not see."""

    owned: frozenset[str]
    """The tiers this node looks after: its node-local ones, and the job-wide ones it keeps when
    the look was made (it alone promotes into them from other job-wide tiers, and retains and
    cleans them; each effect is fenced again by the lease, ``Context.keepers``)."""
    found: Mapping[str, Mapping[str, SeenCopy]] = field(default_factory=dict)
    """Every copy this node can act on: tier -> id -> copy."""
    highest: Mapping[str, int] = field(default_factory=dict)
    """The highest commit number logged in each tier."""
    conflicts: Mapping[str, tuple[Conflict, ...]] = field(default_factory=dict)
    """Each tier's conflict records (:mod:`tierstore.records.conflicts`)."""
    parts: Mapping[str, Parts] = field(default_factory=dict)
    """In each node-local tier, this node's parts of saves coordinated elsewhere."""
    reused: frozenset[str] = frozenset()
    """Tiers whose kept listing the look reused rather than made: nothing is deleted by it."""
    unreachable: Mapping[str, str] = field(default_factory=dict)
    """Tiers the look could not list, and why."""
    unavailable: frozenset[str] = frozenset()
    """Tiers refusing writes when the look was made."""

    def owns(self, tier_name: str) -> bool:
        """Whether this node looks after ``tier_name``: every duty asks here (see ``owned``)."""
        return tier_name in self.owned

    def away(self) -> frozenset[str]:
        """Tiers refusing writes or unreachable."""
        return self.unavailable | frozenset(self.unreachable)

    def copies(self) -> dict[str, dict[str, Copy]]:
        """What the policy decides by: tier -> id -> copy."""
        return {name: {i: s.copy for i, s in seen.items()} for name, seen in self.found.items()}

    def with_conflict(self, tier_name: str, conflict: Conflict) -> View:
        """This view with a conflict record left in ``tier_name`` since the look."""
        known = (*self.conflicts.get(tier_name, ()), conflict)
        return dataclasses.replace(self, conflicts={**self.conflicts, tier_name: known})

    def without(self, deletions: Iterable[Deletion]) -> View:
        """This view without the copies deleted since the look."""
        gone = {(d.tier, d.checkpoint_id) for d in deletions}
        found = {n: {i: s for i, s in seen.items() if (n, i) not in gone} for n, seen in self.found.items()}
        return dataclasses.replace(self, found=found)


def owned(ctx: Context) -> frozenset[str]:
    """The tiers this node looks after now: its node-local ones, and the job-wide ones it keeps
    (:mod:`tierstore.promote.keeper`)."""
    return frozenset(t.name for t in ctx.tiers if t.node_local) | ctx.keepers.kept()


def _from_keeper(
    tier: Tier, token: bytes | None, views: TierViews, started: float, *, full: bool, keys: SigningKeys | None
) -> tuple[TierView, bool] | None:
    """For a tier another promoter keeps, whose stamp moved on (``token``; with ``full``, the stamp
    just read): its keeper's index when it was made after that stamp (a fresh view, to keep), else,
    unless ``full``, the listing kept while the keeper has not indexed the change yet (reused);
    None: list it (no usable index: with the job's ``keys``, one they did not sign; no kept
    listing, or a full listing due)."""
    index = read_index(tier, keys)
    if index is None:  # a keeper that writes none (an older release), or a damaged one
        return None
    if index.token != token and not full:  # the lease's may lag: checked by the stamp now
        token = read_stamp(tier)
    if index.token == token:
        found = indexed(index)
        return TierView(token, started, found, index.highest, index.conflicts), False
    behind = None if full else views.behind(tier.name)
    return None if behind is None else (behind, True)


def _seed(ctx: Context, tier: Tier) -> None:
    """Before this promoter's first listing of a tier it keeps, under the epoch it holds: seed the
    marker cache from the previous keeper's index (an index absent or damaged: every marker is read)."""
    keeper = ctx.keepers.by_tier.get(tier.name)
    epoch = None if keeper is None or not keeper.keeps() else keeper.epoch
    if epoch is None or ctx.cache.seeded.get(tier.name) == epoch:
        return
    ctx.cache.seed(tier.name, read_index(tier, ctx.trust.keys), epoch)


def _publish_index(ctx: Context, tier: Tier, listed: TierView) -> None:
    """Write the index of a tier this promoter keeps, from the listing it just made; fenced by the
    lease, best effort (a reader without it lists the tier)."""
    index = index_of(listed.token, listed.found, listed.highest, listed.conflicts)
    write = functools.partial(write_index, tier, index, ctx.trust.keys)  # signed as the job's markers
    written = False
    try:
        if ctx.keepers.fence(tier.name):  # a no (a tier error, say) leaves an older index there
            ctx.prober.ask(tier, write, what="write its index")
            written = True
    except (TierstoreError, OSError) as exc:
        logger.warning("cannot write the index of tier %s (its watchers list it): %s", tier.name, exc)
    # the lease names this index from now on, or, not written, the stamp: never an older index,
    # which would hide this listing's changes from the watchers while this keeper lists no more
    ctx.keepers.indexed(tier.name, index.token, written=written)


def first_view(ctx: Context) -> View:
    """The view before any look: nothing listed yet; the tiers owned now."""
    return View(owned(ctx))


def look(ctx: Context, views: TierViews, prior: View, *, refresh: bool = True, full: bool = False) -> View:
    """Look at every tier (see the module docstring); ``prior`` is the pass's view so far."""
    found: dict[str, Mapping[str, SeenCopy]] = {}
    highest: dict[str, int] = {}
    conflicts: dict[str, tuple[Conflict, ...]] = {}
    parts: dict[str, Parts] = {}
    reused: set[str] = set()
    kept_elsewhere = ctx.keepers.watched()

    def listing(tier: Tier) -> tuple[TierView, bool]:
        started = time.monotonic()
        watched = tier.name in kept_elsewhere
        # Read before anything it covers is listed (records/changes.py); of a tier another
        # promoter keeps, the lease read anyway names it (its keeper's newest index's token, see
        # Keeper.indexed), except for a full look: the index it takes must be as fresh as a
        # listing made now.
        token = kept_elsewhere[tier.name] if watched and not full else read_stamp(tier)
        kept = None if full else views.reusable(tier.name, token)
        if kept is not None:
            return kept, True
        keys = ctx.trust.keys
        if watched and (from_keeper := _from_keeper(tier, token, views, started, full=full, keys=keys)):
            return from_keeper
        _seed(ctx, tier)
        beat()  # each step answered is progress: only a tier that answers nothing is hung
        known = None if refresh else prior.conflicts.get(tier.name)
        records = read_conflicts(tier) if known is None else list(known)
        beat()
        top = highest_taken(tier) if refresh else prior.highest.get(tier.name, 0)
        beat()
        seen = discover(tier, ctx.cache, records)
        mine = foreign_parts(tier, ctx.cache) if tier.node_local else {}
        return TierView(token, started, seen, top, tuple(records), mine), False

    def listed(index: int) -> tuple[TierView, bool] | TierstoreError | OSError:
        tier = ctx.tiers[index]
        try:
            # a deadline on progress: a first listing reads every marker (minutes at 10,000 retained)
            return ctx.bounded(tier, lambda _progress: listing(tier), what="list its checkpoints")
        except (TierstoreError, OSError) as exc:
            return exc

    # Each tier on a thread of its own (the tiers stand alone): the look takes its slowest tier's
    # time, not the sum (an S3 listing's pages wait on the store while a disk's markers are read).
    outcomes = map_on_daemons(
        list(range(len(ctx.tiers))), listed, width=len(ctx.tiers), name="tierstore-look"
    )
    for index, tier in enumerate(ctx.tiers):
        outcome = outcomes[index]
        if isinstance(outcome, (TierstoreError, OSError)):
            views.forget(tier.name)
            ctx.availability.set_unreachable(tier.name, f"cannot list tier {tier.describe()}: {outcome}")
            refused = isinstance(outcome, TierMisconfiguredError)
            ctx.availability.set_misconfigured(tier.name, "list", str(outcome) if refused else None)
            continue
        listed_now, was_kept = outcome
        if was_kept:
            reused.add(tier.name)
        elif refresh:
            views.keep(tier.name, listed_now)
            if tier.name in ctx.keepers.kept():  # its watchers read this instead of listing
                _publish_index(ctx, tier, listed_now)
        else:  # made with the pass's first log and conflict records: not a listing to keep
            views.forget(tier.name)
        found[tier.name], highest[tier.name] = listed_now.found, listed_now.highest
        conflicts[tier.name], parts[tier.name] = listed_now.conflicts, listed_now.parts
        ctx.availability.set_unreachable(tier.name, None)
        ctx.availability.set_misconfigured(tier.name, "list", None)
    away = ctx.availability  # every tier was just set reachable or not
    unreachable, unavailable = dict(away.unreachable), frozenset(away.unavailable)
    return View(owned(ctx), found, highest, conflicts, parts, frozenset(reused), unreachable, unavailable)
