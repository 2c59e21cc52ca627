"""What is committed where, decided by markers (never by directories), and which checkpoint is newest.

**Newest** is commit order: the sequence number each commit takes (:mod:`tierstore.records.log`), read
from the commit logs of every tier in one listing each. Never the step in the id, never a clock:
after a rollback the new saves are newer than the abandoned higher steps, and ``final`` or
``step100_20240601`` order as committed. The step stays metadata, for display and ``keep_every``.
Copies from before the commit log (tierstore 0.1.0) are ordered by the ``seq`` in their marker.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from tierstore._platform.bounded import Prober
from tierstore._platform.health import said_once
from tierstore.config import Config, as_config
from tierstore.errors import TierMisconfiguredError, TierstoreError, TierUnavailableError
from tierstore.ids import INTERNAL_DIR, MARKER_NAME, is_checkpoint_id, newest_first
from tierstore.records.known import elsewhere_for
from tierstore.records.log import LogEntry, read_head, read_log, read_log_and_voids
from tierstore.records.marker import Manifest, read_manifest
from tierstore.records.sightings import Sighting, read_sightings, trust_period, trusted
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier, is_host_memory
from tierstore.topology import current_node

logger = logging.getLogger(__name__)
T = TypeVar("T")
_PAGE = 64
"""Ids whose markers :meth:`Catalog.listings` reads at a time (in parallel)."""
WINDOW = 512
"""How many numbers below a tier's head record :meth:`Catalog.candidates` lists its log first:
one S3 page of entries, which holds the newest ids a restart looks at."""


def marker_times(tier: Tier) -> dict[str, float]:
    """``{checkpoint id: marker mtime}`` for every id committed in ``tier`` (one listing)."""
    return {
        child: info.mtime
        for child, info in tier.find_in_children(MARKER_NAME, besides=INTERNAL_DIR).items()
        if is_checkpoint_id(child)
    }


def _committed_seq(tier: Tier, checkpoint_id: str, entries: list[LogEntry], trust: MarkerTrust) -> int | None:
    """The logged sequence number of the generation ``tier``'s marker names.

    One entry is the commit itself. Several (an overwrite, or one that failed after claiming its
    number) need the marker to say which generation is committed: a failed overwrite's number must
    not make the id look newer than it is.
    """
    if len(entries) == 1:
        return entries[0].seq
    try:
        generation = read_manifest(tier, checkpoint_id, trust=trust).generation
    except Exception:  # noqa: BLE001 - an unreadable marker: the copy is not counted
        return None
    return max((e.seq for e in entries if e.generation == generation), default=None)


@dataclass(frozen=True)
class Listing:
    """One checkpoint as ``tierstore ls`` shows it."""

    checkpoint_id: str
    tiers: tuple[str, ...]
    bytes: int
    committed_at: float
    step: int | None
    timings: dict[str, float | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (``id``, ``tiers``, ``bytes``, ``step``, ``committed_at``, timings)."""
        return {
            "id": self.checkpoint_id,
            "tiers": list(self.tiers),
            "bytes": self.bytes,
            "step": self.step,
            "committed_at": self.committed_at,
            "age_s": max(0.0, time.time() - self.committed_at),
            **{k: v for k, v in self.timings.items()},
        }


class Catalog:
    """Markers across every tier of a configuration, as seen from one node."""

    def __init__(
        self,
        config: Config | str | os.PathLike[str],
        *,
        node: int | None = None,
        tiers: list[Tier] | None = None,
    ) -> None:
        """``tiers``: the configuration's tiers as the caller already made them for ``node`` (their
        clients are reused); by default they are made here."""
        self.config = as_config(config)
        self.node = current_node(node)
        self.tiers = self.config.make_tiers(node=self.node) if tiers is None else tiers
        self.trust = self.config.marker_trust()
        self.prober = Prober(self.config.probe_timeout)
        self.unreachable: dict[str, str] = {}
        """``{tier name: why}`` for each tier this catalog could not list (within
        ``probe_timeout``): what it answers covers the other tiers only."""
        self.refused: set[str] = set()
        """The unreachable tiers that refused for a reason waiting will not cure (no bucket, refused
        credentials): a configuration to fix, not an outage."""

    def _ask(self, tier: Tier, question: Callable[[Tier], T], what: str) -> T | None:
        """``question(tier)`` within ``probe_timeout``; None (and the tier recorded as unreachable,
        with one warning) when it does not answer."""
        try:
            return self.prober.ask(
                tier, functools.partial(question, tier), what=what, direct=is_host_memory(tier)
            )
        except (TierstoreError, OSError) as exc:
            if tier.name not in self.unreachable:
                logger.log(said_once(tier), "tier %s is unreachable, left out: %s", tier.name, exc)
            self.unreachable[tier.name] = str(exc)
            if isinstance(exc, TierMisconfiguredError):
                self.refused.add(tier.name)
            return None

    def _reachable(self, tiers: list[Tier], question: Callable[[Tier], T], what: str) -> list[tuple[Tier, T]]:
        """``question`` asked of each tier in parallel; the tiers that answered, with answers."""
        if len(tiers) == 1:
            answers = [self._ask(tiers[0], question, what)]
        else:
            with ThreadPoolExecutor(len(tiers)) as pool:
                answers = list(pool.map(lambda t: self._ask(t, question, what), tiers))
        return [(t, a) for t, a in zip(tiers, answers, strict=True) if a is not None]

    def scan(self) -> dict[str, dict[str, float]]:
        """``{id: {tier name: marker mtime}}`` for every committed copy in the tiers that answer
        (listed in parallel; the others are in :attr:`unreachable`)."""
        merged: dict[str, dict[str, float]] = {}
        for tier, found in self._reachable(self.tiers, marker_times, "list its markers"):
            for checkpoint_id, mtime in found.items():
                merged.setdefault(checkpoint_id, {})[tier.name] = mtime
        return merged

    def sequences(self, scanned: dict[str, dict[str, float]]) -> dict[str, int | None]:
        """``{id: its commit sequence}`` for the scanned ids: the highest logged for that id in a
        tier holding its marker; for unlogged (older) copies, the ``seq`` in the marker."""
        scanned_tiers = [t for t in self.tiers if t.name not in self.unreachable]
        logs = {t.name: log for t, log in self._reachable(scanned_tiers, read_log, "list its log")}
        by_name = {t.name: t for t in self.tiers}
        found: dict[str, int | None] = {}
        for tier_name, log in logs.items():
            per_id: dict[str, list[LogEntry]] = {}
            for entry in log:
                if tier_name in scanned.get(entry.checkpoint_id, {}):
                    per_id.setdefault(entry.checkpoint_id, []).append(entry)
            for checkpoint_id, entries in per_id.items():
                seq = _committed_seq(by_name[tier_name], checkpoint_id, entries, self.trust)
                if seq is not None:
                    found[checkpoint_id] = max(found.get(checkpoint_id) or 0, seq)
        for checkpoint_id in scanned.keys() - found.keys():
            found[checkpoint_id] = None
            for tier_name in scanned[checkpoint_id]:
                if tier_name in self.unreachable:  # its reads were not answered: not waited for
                    continue
                try:
                    manifest = read_manifest(by_name[tier_name], checkpoint_id, trust=self.trust)
                    found[checkpoint_id] = manifest.seq
                    break
                except Exception:  # noqa: BLE001, S112 - a bad marker: another tier may do
                    continue
        return found

    def newest_first(self, scanned: dict[str, dict[str, float]]) -> list[str]:
        """The scanned ids, newest first (see the module docstring)."""
        return newest_first(self.sequences(scanned).items())

    def candidates(self, also: Mapping[str, int | None] | None = None) -> Iterator[str]:
        """Ids with a valid marker in some tier, newest first, in the order :meth:`newest_first`
        gives them; without listing any data file (a whole-namespace listing costs a request per
        1000 objects: every rank's files of every checkpoint, in S3).

        Each tier is asked for two short listings: its commit log (one entry per commit) and its
        top-level ids. An id is placed by its newest log entry whose generation is committed: by
        that tier's marker, or by another tier's marker of the same generation (the copy was
        promoted, then evicted, while this ran). A marker whose generation its tier's log does not
        name (a copy from before the log, a promotion stopped between its marker and its entry,
        a swap since the listing) is placed by the ``seq`` in it; such markers, and those of ids
        with several entries in a tier, are read at once, every other marker lazily, newest entry
        first (an id's lone entry that its marker does not name, a claim or a swap that never
        happened, then yields to the marker's ``seq``). A damaged marker is skipped with a warning; a missing
        one (a save in progress, a failed or deleted commit) is not a copy. ``also``: ``{id: seq}``
        held where these tiers cannot see (peer mirrors on other nodes), placed at that seq as is.

        Tiers stand alone: only the fastest tier, and the tiers the promoter has not sighted there
        (:mod:`tierstore.records.sightings`), are listed, each within ``probe_timeout``; a sighted
        tier's commits come from its sighting, and its marker is read only to place an id that
        moved while this ran. A tier that does not answer is left out (:attr:`unreachable`).
        """
        first = self.tiers[0]
        sightings = trusted(
            self._ask(first, read_sightings, "read sightings") or {},
            trust_period(self.config.promote.interval),
        )
        sighted = [t for t in self.tiers[1:] if t.name in sightings]
        listed = [first, *(t for t in self.tiers[1:] if t.name not in sightings)]
        commits = functools.partial(_CommitOrder, trust=self.trust)
        orders: list[_CommitOrder | _Sighted] = [
            order for _t, order in self._reachable(listed, commits, "list its commits")
        ]
        if not orders:  # nothing could be listed: "nothing committed" would be a guess
            reasons = "; ".join(f"{n}: {why}" for n, why in sorted(self.unreachable.items()))
            raise TierUnavailableError(f"no tier could be listed: {reasons}")
        orders += [_Sighted(t.name, sightings[t.name], self._resighted(first, t.name)) for t in sighted]
        pending = sorted(  # oldest first: the newest is popped off the end
            [
                (seq, checkpoint_id, i, generation)
                for i, order in enumerate(orders)
                for seq, checkpoint_id, generation in order.items
            ]
            + [(seq, checkpoint_id, -1, None) for checkpoint_id, seq in (also or {}).items()]
            + [(seq, checkpoint_id, -1, None) for checkpoint_id, seq in self._own(sightings)],
            key=_placing,
        )
        placed: set[str] = set()
        while True:
            floor = max(order.floor for order in orders)
            if floor and (not pending or (pending[-1][0] or 0) <= floor):
                # Below the floor of a tier listed only above its head's window: its older
                # entries may come first now, so every such tier is listed in full.
                self._list_rest(orders, pending)
                continue
            if not pending:
                return
            _seq, checkpoint_id, i, generation = pending.pop()
            if checkpoint_id in placed:
                continue
            held = True if i < 0 else orders[i].holds(checkpoint_id, generation)
            if held is None:  # no marker in the entry's own tier: promoted elsewhere meanwhile?
                held = any(o.names(checkpoint_id, generation) for o in orders if o is not orders[i])
            elif not held:
                if orders[i].floor:  # the id's other entries in that tier may lie below the floor
                    self._list_rest(orders, pending)
                if (by_marker := orders[i].placed_by_marker(checkpoint_id)) is not None:
                    bisect.insort(pending, (*by_marker, i, None), key=_placing)
            if held:
                placed.add(checkpoint_id)
                yield checkpoint_id

    def _list_rest(
        self, orders: list[_CommitOrder | _Sighted], pending: list[tuple[int | None, str, int, str | None]]
    ) -> None:
        """List in full every tier listed only above its floor (within ``probe_timeout``; one that
        does not answer now is left out), and add its items to ``pending``."""
        for i, order in enumerate(orders):
            if not isinstance(order, _CommitOrder) or not order.floor:
                continue
            rest = self._ask(order.tier, order.rest, "list its commits") or []
            order.floor = 0
            for seq, checkpoint_id, generation in rest:
                bisect.insort(pending, (seq, checkpoint_id, i, generation), key=_placing)

    def _resighted(self, first: Tier, name: str) -> Callable[[], Sighting | None]:
        def reread() -> Sighting | None:
            found = self._ask(first, read_sightings, "read sightings") or {}
            return found.get(name)

        return reread

    def _own(self, sightings: dict[str, Sighting]) -> list[tuple[str, int | None]]:
        """This process's own commits (a ``tier=`` save just made) that no sighting has seen yet."""
        known = elsewhere_for(self.tiers)
        return [(i, seq) for i, (_tier, seq, _gen) in known.own_commits(sightings).items()]

    def listings(self, limit: int | None = None) -> list[Listing]:
        """Every committed checkpoint, newest first, with sizes and timings from its markers;
        with ``limit``, the newest ``limit`` only.

        With ``limit``, the ids come from :meth:`candidates` (each tier's log above its head
        record's floor: a few requests per tier, however many checkpoints are kept), and each
        shown id's marker is read in every tier. Without, every tier's markers are listed and
        read a page at a time, newest id first.
        """
        if limit is not None:
            return self._newest(limit)
        scanned = self.scan()
        order = self.newest_first(scanned)
        listings: list[Listing] = []
        with ThreadPoolExecutor(16) as pool:
            for start in range(0, len(order), _PAGE):
                ids = order[start : start + _PAGE]
                jobs = [(i, name) for i in ids for name in scanned[i]]
                manifests = dict(zip(jobs, pool.map(self._marker, jobs), strict=True))
                listings += [x for i in ids if (x := self._listing(i, manifests)) is not None]
        return listings

    def _newest(self, limit: int) -> list[Listing]:
        """The newest ``limit`` listings, in :meth:`candidates`' order (see :meth:`listings`)."""
        try:
            order = self.candidates()
            listings: list[Listing] = []
            with ThreadPoolExecutor(16) as pool:
                while len(listings) < limit and (ids := list(itertools.islice(order, limit - len(listings)))):
                    jobs = [(i, t.name) for i in ids for t in self.tiers]
                    manifests = dict(zip(jobs, pool.map(self._marker, jobs), strict=True))
                    listings += [x for i in ids if (x := self._listing(i, manifests)) is not None]
        except TierUnavailableError:  # no tier could be listed: each is in ``unreachable``
            return []
        return listings

    def _marker(self, job: tuple[str, str]) -> Manifest | None:
        """The marker of ``(id, tier name)``; None when absent (deleted since the listing, or never
        there), unreadable (warned) or the tier is away."""
        checkpoint_id, name = job
        tier = next(t for t in self.tiers if t.name == name)
        if name in self.unreachable:  # one unanswered read: the others are not waited for
            return None
        try:  # a hung read (a storage target down, GETs that never answer) costs one deadline
            return self.prober.ask(
                tier,
                functools.partial(read_manifest, tier, checkpoint_id, trust=self.trust),
                what=f"read the marker of {checkpoint_id}",
                direct=is_host_memory(tier),
            )
        except TierUnavailableError as exc:
            if name not in self.unreachable:
                logger.log(said_once(tier), "tier %s is unreachable, left out: %s", name, exc)
            self.unreachable[name] = str(exc)
            return None
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Exception as exc:  # noqa: BLE001 - listed as unusable rather than failing ls
            logger.warning("ignoring marker of %s in %s: %s", checkpoint_id, name, exc)
            return None

    def _listing(
        self, checkpoint_id: str, manifests: dict[tuple[str, str], Manifest | None]
    ) -> Listing | None:
        """One id's listing from its markers in the tiers that hold a readable one (else None)."""
        held = [
            t.name
            for t in self.tiers
            if t.name not in self.unreachable and manifests.get((checkpoint_id, t.name)) is not None
        ]
        if not held:
            return None
        markers = [m for n in held if (m := manifests[(checkpoint_id, n)]) is not None]
        first = markers[0]
        timings = dict(first.timings)
        lags = [lag for m in markers if (lag := m.timings.get("durable_lag_s")) is not None]
        if lags:
            timings["durable_lag_s"] = min(lags)
        original = min(float((m.provenance or {}).get("first_committed_at", m.committed_at)) for m in markers)
        return Listing(checkpoint_id, tuple(held), first.total_bytes, original, first.step, timings)


def _placing(item: tuple[int | None, str, int, str | None]) -> tuple[bool, int, str, int]:
    """The order :meth:`Catalog.candidates` places items in, reversed (newest last). Of equal
    items, a tier's own entry comes before what is known without asking it (``also``, this
    process's commits: index -1), the fastest tier's first: those entries read the markers that
    notice a copy moving while this runs."""
    return (item[0] is not None, item[0] or 0, item[1], -item[2] if item[2] >= 0 else -(1 << 30))


class _Sighted:
    """A tier known from its sighting in the fastest tier: its items, taken as committed (a restore
    checks them). The tier itself is never asked: an id that moved there while the catalog ran is
    found in its sighting read again (the promoter records it in the pass that moved the id)."""

    floor = 0
    """Everything sighted is known: no part of it is left to list."""

    def __init__(self, name: str, sighting: Sighting, reread: Callable[[], Sighting | None]) -> None:
        self.name, self.reread = name, reread
        self.items: list[tuple[int | None, str, str | None]] = [
            (seq, checkpoint_id, generation) for checkpoint_id, (seq, generation) in sighting.ids.items()
        ]

    def holds(self, checkpoint_id: str, generation: str | None) -> bool | None:
        """Sighted commits are taken as held."""
        return True

    def placed_by_marker(self, checkpoint_id: str) -> tuple[int | None, str] | None:
        """Never needed: a sighted item is always held."""
        return None

    def names(self, checkpoint_id: str, generation: str | None) -> bool:
        """True when the sighting, read again now, names ``generation`` of the id."""
        sighting = self.reread()
        return sighting is not None and sighting.ids.get(checkpoint_id, (0, ""))[1] == generation


class _CommitOrder:
    """One tier's commits, for :meth:`Catalog.candidates`: ``items`` to order, ``(seq, id,
    generation)`` (generation None: placed by its marker, already read), and every marker read so
    far (each at most once).

    With a head record that says every marker was logged (:class:`~tierstore.records.log.Head`),
    only the log above ``floor`` (:data:`WINDOW` below the head) is listed at first: one request in
    S3 at any retained count. :meth:`rest` lists the whole log and the top-level ids when the
    caller asks past what lies above it (``floor`` is then 0). A head above every number listed
    (a promotion cut between its marker and its entry) has the whole tier listed at once."""

    def __init__(self, tier: Tier, *, trust: MarkerTrust) -> None:
        self.tier, self.trust = tier, trust
        self.markers: dict[str, Manifest | None] = {}
        head = read_head(tier)
        self.floor = head.seq - WINDOW if head is not None and head.logged and head.seq > WINDOW else 0
        log, voids = read_log_and_voids(tier, above=self.floor)
        if self.floor and head is not None and head.seq > max([0, *voids, *(e.seq for e in log)]):
            self.floor = 0  # a number the log lost (a cut after a promotion's marker): list it all
            log = read_log(tier)
        self.items = self._order(log)

    def rest(self, tier: Tier) -> list[tuple[int | None, str, str | None]]:
        """The items not listed yet, listed now as if there were no head record (the whole log,
        the top-level ids); [] when everything was listed. ``tier``: this order's tier."""
        if not self.floor:
            return []
        self.floor, before = 0, set(self.items)
        self.items = self._order(read_log(tier))
        return [item for item in self.items if item not in before]

    def _order(self, log: list[LogEntry]) -> list[tuple[int | None, str, str | None]]:
        """The items of ``log`` (the whole log when :attr:`floor` is 0: then also the markers the
        log does not name), with the markers of ids with several entries read at once."""
        self.entries: dict[str, list[LogEntry]] = {}
        for entry in log:
            self.entries.setdefault(entry.checkpoint_id, []).append(entry)
        listed = [] if self.floor else self.tier.list_dir("")
        unlogged = [c for c in listed if is_checkpoint_id(c) and c not in self.entries]
        several = [c for c, entries in self.entries.items() if len(entries) > 1]  # overwrites
        eager = unlogged + several
        unread = [c for c in eager if c not in self.markers]
        if unread:  # many only in a tier written before the commit log: read in parallel
            with ThreadPoolExecutor(min(16, len(unread))) as pool:
                self.markers.update(zip(unread, pool.map(self._read, unread), strict=True))
        items: list[tuple[int | None, str, str | None]] = [
            (e.seq, e.checkpoint_id, e.generation) for e in _flat(self.entries)
        ]
        for checkpoint_id in eager:
            manifest = self.markers[checkpoint_id]
            logged = {e.generation for e in self.entries.get(checkpoint_id, [])}
            if manifest is not None and manifest.generation not in logged:
                items.append((manifest.seq, checkpoint_id, None))
        return items

    def marker(self, checkpoint_id: str) -> Manifest | None:
        """The tier's marker of ``checkpoint_id``; None when absent or unreadable (warned)."""
        if checkpoint_id not in self.markers:
            self.markers[checkpoint_id] = self._read(checkpoint_id)
        return self.markers[checkpoint_id]

    def _read(self, checkpoint_id: str) -> Manifest | None:
        try:
            return read_manifest(self.tier, checkpoint_id, trust=self.trust)
        except (FileNotFoundError, NotADirectoryError):  # a stray file named like an id
            return None
        except Exception as exc:  # noqa: BLE001 - a bad marker is skipped, with a warning
            logger.warning("ignoring marker of %s in %s: %s", checkpoint_id, self.tier.name, exc)
            return None

    def holds(self, checkpoint_id: str, generation: str | None) -> bool | None:
        """Whether the item ``(id, generation)`` is this tier's commit of the id: its marker names
        that generation (or the item came from the marker). None when the tier has no valid
        marker of the id at all."""
        manifest = self.marker(checkpoint_id)
        if manifest is None:
            return None
        return generation is None or manifest.generation == generation

    def placed_by_marker(self, checkpoint_id: str) -> tuple[int | None, str] | None:
        """``(seq, id)`` from the id's marker when its generation has no entry in the listing:
        the lone entry of an id is not always its commit (an overwrite's number claimed or logged
        before a swap that never happened), nor is the listing always as new as the marker (a
        promotion swapped it since). The marker, read already, then places the id. None when
        the listing names the marker's generation (that entry places it) or it was read at once
        (its item is already there)."""
        manifest = self.markers.get(checkpoint_id)
        entries = self.entries.get(checkpoint_id, [])
        if manifest is None or len(entries) != 1 or entries[0].generation == manifest.generation:
            return None
        return manifest.seq, checkpoint_id

    def names(self, checkpoint_id: str, generation: str | None) -> bool:
        """True when this tier's valid marker of the id names ``generation``, read now: one read
        earlier may predate the promotion that moved the copy here."""
        self.markers[checkpoint_id] = manifest = self._read(checkpoint_id)
        return manifest is not None and manifest.generation == generation


def _flat(entries: dict[str, list[LogEntry]]) -> list[LogEntry]:
    return [entry for per_id in entries.values() for entry in per_id]
