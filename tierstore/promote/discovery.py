"""What a promoter on one node can see in each tier: committed copies, and this node's parts.

In job-wide tiers (shared, s3) and on the coordinator's node, a copy is committed when its marker is
there. Other nodes never see the coordinator's node-local marker, so in a node-local tier they learn
about their part of a checkpoint from the per-rank part records the writer left next to the data
(``<id>/<gen>/parts/rankNNNNN.json``). A node that holds rank 0's part record is the coordinator's node,
and there a part without a marker is an uncommitted save: it is ignored.

Markers are parsed once per (tier, id, mtime, size): a listing does not re-read a marker that has not
changed; a keeper's first listing of its tier reads only the markers changed since its previous
keeper's index (:meth:`MarkerCache.seed`). Whether a tier is listed at all in a pass is the
promoter's call: it reuses its previous listing while the tier's change stamp holds
(:mod:`tierstore.promote.views`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tierstore._platform.bounded import beat, beats_here
from tierstore._platform.runtime import map_on_daemons
from tierstore.errors import TierstoreError, TierUnavailableError
from tierstore.ids import (
    generation_dir,
    is_checkpoint_id,
    is_generation,
    marker_path,
    parts_dir,
    rank_part_path,
    step_of,
)
from tierstore.promote.policy import Copy
from tierstore.records.catalog import marker_times
from tierstore.records.clock import clock_offset, tier_now
from tierstore.records.conflicts import Conflict, read_conflicts
from tierstore.records.index import Index, IndexedCopy
from tierstore.records.marker import Manifest, read_manifest
from tierstore.records.parts import PartRecord, part_records
from tierstore.signing import MarkerTrust
from tierstore.tiers import LocalFace, Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeenCopy:
    """One copy in one tier as this node sees it: the marker's manifest (if read) and local parts.

    A committed copy seen through its keeper's index (:mod:`tierstore.records.index`) has no
    manifest: what needs one reads the marker (:func:`marker_of`)."""

    copy: Copy
    manifest: Manifest | None
    parts: tuple[PartRecord, ...] = ()
    started_at: float | None = None
    """When its save started (the marker's ``timings``), if it says."""
    settled_mtime: float | None = None
    """The mtime its marker was listed at, when the copy's content is settled for it
    (:class:`MarkerCache`: trusted from the cache): what a keeper's index records
    (:attr:`~tierstore.records.index.IndexedCopy.marker_mtime`). None: not settled, or not known."""

    @property
    def committed(self) -> bool:
        """A commit of the tier (its marker is there), not only this node's part of one."""
        return not self.copy.partial


def marker_of(seen: SeenCopy, tier: Tier, trust: MarkerTrust) -> Manifest:
    """The manifest of a committed copy: the one read by the listing, else its marker read now
    (a copy seen through an index). Raises what reading it raises."""
    if seen.manifest is not None:
        return seen.manifest
    return read_manifest(tier, seen.copy.checkpoint_id, trust=trust)


@dataclass(frozen=True)
class _Cached:
    mtime: float
    manifest: Manifest
    listed: float
    """When (this process's monotonic clock) a listing first showed the marker at ``mtime``."""
    settled: bool
    """``manifest`` is the marker's content for as long as it shows ``mtime`` (the class docstring)."""


_DirTimes = tuple[float | None, tuple[tuple[str, float | None, float | None], ...]]
"""A checkpoint directory's mtime, and each generation directory's and its parts directory's."""


@dataclass(frozen=True)
class _CachedParts:
    times: _DirTimes
    records: dict[str, list[PartRecord]]
    listed: float
    """When (this process's monotonic clock) these directory times were first seen."""
    read_at: float


@dataclass
class MarkerCache:
    """Parsed markers keyed by (tier, id), valid while the listing shows the same mtime.

    Stores with a coarse clock (S3 and some filesystems: 1 s) give a marker replaced within the same
    second the same mtime, so a marker is trusted from the cache only once it was read at least
    :data:`SETTLE` seconds after a listing already showed that mtime (both times this process's
    monotonic clock), or read when the tier's own clock (:func:`~tierstore.records.clock.tier_now`,
    probed before the read) was :data:`SETTLED_AGE` past that mtime: either way a replacement after
    that read has a later mtime. Neither compares this host's clock with the tier's: a promoter
    whose clock is off trusts nothing sooner. The second rule is what lets a new promoter's first
    pass count its reads of old markers (its second pass then reads none, and a keeper's index
    holds them settled for the next keeper).
    """

    trust: MarkerTrust
    """Which markers it reads (:func:`~tierstore.records.marker.read_manifest`)."""
    entries: dict[tuple[str, str], _Cached] = field(default_factory=dict)
    seeds: dict[tuple[str, str], SeenCopy] = field(default_factory=dict)
    """Copies by (tier, id) as a keeper's index holds them, each valid for the marker mtime its
    writer had it settled for (:meth:`seed`)."""
    seeded: dict[str, int] = field(default_factory=dict)
    """The keeper epoch under which each tier's seeds were taken."""
    parts_read: dict[tuple[str, str], _CachedParts] = field(default_factory=dict)
    """Part records by (tier, id), valid while no directory they were listed from changed."""
    foreign: set[tuple[str, str]] = field(default_factory=set)
    """``(tier, name)`` of the foreign files in tier roots already warned about (once per run)."""

    def warn_foreign(self, tier: Tier, name: str) -> None:
        """Say once per run that ``name`` in ``tier``'s root is a foreign file, left alone."""
        if (tier.name, name) not in self.foreign:
            self.foreign.add((tier.name, name))
            logger.warning(
                "tier %s: %s in its root is a file, not a checkpoint: ignored, left alone",
                tier.describe(),
                name,
            )

    def keep_only(self, tier_name: str, present: set[str]) -> None:
        """Forget what is cached of ``tier_name``'s ids not in ``present`` (its latest listing): a
        promoter runs for weeks, and each deleted checkpoint would keep its parsed marker (every
        rank's files) and part records in memory for good."""
        for cached in (self.entries, self.parts_read, self.seeds):
            # list(): one step under the GIL. Reads of a slow tier that the Prober gave up on
            # still add entries (and drop seeds) from their threads while another tier's listing
            # runs this.
            for key in [k for k in list(cached) if k[0] == tier_name and k[1] not in present]:
                cached.pop(key, None)

    def read(
        self, tier: Tier, checkpoint_id: str, mtime: float, *, tier_time: float | None = None
    ) -> Manifest:
        """The marker's manifest, from the cache when it cannot have changed since. ``tier_time``:
        the tier's clock taken before this read, if known (the second rule of the class docstring)."""
        key = (tier.name, checkpoint_id)
        cached = self.entries.get(key)
        if cached is not None and self.trusted(tier, checkpoint_id, mtime):
            return cached.manifest
        same = cached is not None and cached.mtime == mtime
        listed = cached.listed if cached is not None and same else time.monotonic()
        aged = tier_time is not None and tier_time - mtime >= SETTLED_AGE
        settled = aged or time.monotonic() - listed >= SETTLE  # taken before the read starts
        manifest = read_manifest(tier, checkpoint_id, trust=self.trust)
        self.entries[key] = _Cached(mtime, manifest, listed, settled)
        self.seeds.pop(key, None)
        return manifest

    def seed(self, tier_name: str, index: Index | None, epoch: int) -> None:
        """Take the copies of ``index`` (the tier's, as its previous keeper wrote it) whose marker
        its writer had settled: a listing that shows one's marker at that very mtime uses it
        instead of reading the marker (:meth:`from_seeds`), as this cache does with a marker it
        read itself. The writer's trust carries over: a marker replaced after its settled read has
        a later mtime, whoever lists it. With signed markers, only an index the job's key signed
        (:func:`~tierstore.records.index.read_index`, given the keys) may be given."""
        self.seeded[tier_name] = epoch
        if index is None:
            return
        for row in index.copies:
            if row.marker_mtime is not None:
                self.seeds[(tier_name, row.checkpoint_id)] = _seen_of(row)

    def from_seeds(self, tier: Tier, mtimes: Mapping[str, float]) -> dict[str, SeenCopy]:
        """The copies of ``mtimes`` (each marker's listed mtime) a seed holds at that mtime, of
        those this cache does not trust a manifest of."""
        seeds = ((i, self.seeds.get((tier.name, i))) for i in mtimes)
        return {
            i: s
            for i, s in seeds
            if s is not None and s.settled_mtime == mtimes[i] and not self.trusted(tier, i, mtimes[i])
        }

    def read_all(self, tier: Tier, mtimes: Mapping[str, float]) -> dict[str, Manifest | Exception]:
        """:meth:`read` of each id of ``mtimes`` (its marker's listed mtime): the manifest, or the
        exception that reading it raised (a damaged marker). Markers the cache cannot serve are
        read :data:`READ_AHEAD` at a time from a tier without local files: a promoter's first pass
        over a thousand S3 markers waits a round trip per 16 markers, not per marker."""

        progress = beats_here()  # each marker read is progress of the pass's bounded look
        unread = [i for i in mtimes if not self.trusted(tier, i, mtimes[i])]
        tier_time = _clock_for(tier, [mtimes[i] for i in unread])

        def one(checkpoint_id: str) -> Manifest | Exception:
            try:
                manifest = self.read(tier, checkpoint_id, mtimes[checkpoint_id], tier_time=tier_time)
            except TierUnavailableError:  # the tier, not the copy: the look fails
                raise
            except Exception as exc:  # noqa: BLE001 - that copy is not usable; the caller says so
                progress(1)  # the tier answered (a damaged marker, one gone since the listing)
                return exc
            progress(1)
            return manifest

        if tier.local is not None or len(unread) < 2:
            return {i: one(i) for i in mtimes}
        # Daemons, like the Prober's that bounds the pass: reads a hung store leaves pending after
        # the pass gave up must not hold the process's exit.
        fetched = map_on_daemons(unread, one, width=READ_AHEAD, name="tierstore-marker-read")
        return {i: fetched[i] if i in fetched else one(i) for i in mtimes}

    def trusted(self, tier: Tier, checkpoint_id: str, mtime: float) -> bool:
        """Whether the manifest cached of ``checkpoint_id`` is settled for its marker at ``mtime``
        (see the class docstring): served without a read."""
        cached = self.entries.get((tier.name, checkpoint_id))
        return cached is not None and cached.mtime == mtime and cached.settled

    def parts(self, tier: Tier, checkpoint_id: str) -> dict[str, list[PartRecord]]:
        """:func:`~tierstore.records.parts.part_records`, from the cache while the checkpoint's
        directory, its generations' and their parts directories keep their mtimes (a record is
        written by a rename into its directory, dropped by an unlink: either changes it). Trusted
        on the terms of :meth:`read` (:data:`SETTLE`). Read afresh in tiers without directories."""
        if (local := tier.local) is None:
            return part_records(tier, checkpoint_id)
        key = (tier.name, checkpoint_id)
        cached, same = self.parts_read.get(key), False
        if cached is not None:
            times = _dir_times(local, checkpoint_id, [g for g, _t, _p in cached.times[1]])
            same = times == cached.times
            if same and cached.read_at - cached.listed >= SETTLE:
                return cached.records
        listed = cached.listed if cached is not None and same else time.monotonic()
        generations = [g for g in tier.list_dir(checkpoint_id) if is_generation(g)]
        times = _dir_times(local, checkpoint_id, generations)
        records = part_records(tier, checkpoint_id)
        if _dir_times(local, checkpoint_id, generations) != times:  # changed while read: not kept
            self.parts_read.pop(key, None)
            return records
        self.parts_read[key] = _CachedParts(times, records, listed, time.monotonic())
        return records


def _dir_times(local: LocalFace, checkpoint_id: str, generations: list[str]) -> _DirTimes:
    return (
        local.directory_mtime(checkpoint_id),
        tuple(
            (
                generation,
                local.directory_mtime(generation_dir(checkpoint_id, generation)),
                local.directory_mtime(parts_dir(checkpoint_id, generation)),
            )
            for generation in generations
        ),
    )


READ_AHEAD = 16
"""Markers read at once from a tier without local files (S3), where each read is a round trip."""

SETTLE = 2.0
"""Seconds between first listing a marker's mtime and reading it before the read is trusted from the
cache (mtimes may be whole seconds)."""

SETTLED_AGE = 120.0
"""How far past a marker's mtime the tier's clock must be when the marker is read for that first read
to be trusted. A marker is stamped when its write starts (S3) or before its rename (POSIX), and on a
filesystem whose clients stamp times the hosts' clocks may differ by up to ``activity_ttl / 2``
(docs/operations.md, "Clocks"): a same-second replacement would have had to be in flight for longer
than both."""


def _clock_for(tier: Tier, unread: Sequence[float]) -> float | None:
    """The tier's clock before reading markers listed at the ``unread`` mtimes: only when this host's
    clock says one of them is old enough to count (a guess deciding nothing but whether the probe's
    three requests may pay off). None: not probed, or the probe failed (a tier that refuses writes:
    read-only, full, credentials that may only read): then only :data:`SETTLE` settles a read."""
    if not unread or time.time() - min(unread) < SETTLED_AGE:
        return None
    try:
        return tier_now(tier)
    except (TierstoreError, OSError) as exc:  # refused (read-only, full), or away: the reads will tell
        logger.debug("tier %s: cannot probe its clock (%s): markers settle by SETTLE alone", tier.name, exc)
        return None


def copy_of(manifest: Manifest) -> Copy:
    """The catalog entry for a committed copy."""
    return Copy(
        manifest.checkpoint_id,
        manifest.seq,
        manifest.step,
        manifest.committed_at,
        manifest.generation,
        source=str((manifest.provenance or {}).get("tier", "")),
        overwrite=manifest.overwrite,
        unseen_tiers=frozenset(manifest.unseen_tiers),
    )


def _started(manifest: Manifest) -> float | None:
    started = manifest.timings.get("started_at")
    return None if started is None else float(started)


def index_of(
    token: bytes | None, found: Mapping[str, SeenCopy], highest: int, conflicts: Sequence[Conflict]
) -> Index:
    """The index of a job-wide tier listed after reading ``token`` (what its keeper publishes)."""
    copies = tuple(
        IndexedCopy(
            c.checkpoint_id,
            c.seq,
            c.step,
            c.committed_at,
            c.generation,
            c.source,
            c.overwrite,
            tuple(sorted(c.unseen_tiers)),
            s.started_at,
            s.settled_mtime,
        )
        for s in found.values()
        if s.committed and (c := s.copy)
    )
    return Index(token, highest, tuple(conflicts), copies)


def indexed(index: Index) -> dict[str, SeenCopy]:
    """The copies of a job-wide tier as its index holds them, with their conflicts (as
    :func:`discover` gives them)."""
    found = {c.checkpoint_id: _seen_of(c) for c in index.copies}
    return _with_conflicts(found, index.conflicts)


def _seen_of(row: IndexedCopy) -> SeenCopy:
    """One copy as an index row holds it (no manifest, no conflicts)."""
    copy = Copy(
        row.checkpoint_id,
        row.seq,
        row.step,
        row.committed_at,
        row.generation,
        source=row.source,
        overwrite=row.overwrite,
        unseen_tiers=frozenset(row.unseen_tiers),
    )
    return SeenCopy(copy, None, started_at=row.started_at, settled_mtime=row.marker_mtime)


def discover(
    tier: Tier, cache: MarkerCache, conflicts_known: list[Conflict] | None = None
) -> dict[str, SeenCopy]:
    """Every copy in ``tier`` this node can act on (see the module docstring), with the tiers each
    is in conflict with (:mod:`tierstore.records.conflicts`; read from the tier unless given)."""
    records = read_conflicts(tier) if conflicts_known is None else conflicts_known
    return _with_conflicts(_discover(tier, cache), records)


def _with_conflicts(found: dict[str, SeenCopy], records: Iterable[Conflict]) -> dict[str, SeenCopy]:
    """``found`` with each copy's conflicts (the tiers its conflict records name)."""
    conflicts: dict[tuple[str, str], set[str]] = {}
    for conflict in records:
        conflicts.setdefault((conflict.checkpoint_id, conflict.generation), set()).add(conflict.target)
    for checkpoint_id, seen in found.items():
        targets = conflicts.get((checkpoint_id, seen.copy.generation))
        if targets:
            copy = dataclasses.replace(seen.copy, conflicts=frozenset(targets))
            found[checkpoint_id] = dataclasses.replace(seen, copy=copy)
    return found


def _discover(tier: Tier, cache: MarkerCache) -> dict[str, SeenCopy]:
    sources: dict[str, SeenCopy] = {}
    committed = marker_times(tier)
    beat()  # the listing answered: progress of a bounded look
    sources.update(cache.from_seeds(tier, committed))
    unread = {i: mtime for i, mtime in committed.items() if i not in sources}
    for checkpoint_id, manifest in cache.read_all(tier, unread).items():
        if isinstance(manifest, Exception):  # a damaged marker: that copy is not usable
            logger.warning("ignoring marker %s in tier %s: %s", checkpoint_id, tier.name, manifest)
            continue
        parts: tuple[PartRecord, ...] = ()
        if tier.node_local:
            parts = tuple(cache.parts(tier, checkpoint_id).get(manifest.generation, []))
        mtime = committed[checkpoint_id]
        settled = mtime if cache.trusted(tier, checkpoint_id, mtime) else None
        sources[checkpoint_id] = SeenCopy(copy_of(manifest), manifest, parts, _started(manifest), settled)
    if not tier.node_local:
        cache.keep_only(tier.name, set(committed))
        return sources
    clock = _TierTimes(tier)
    listed = tier.list_dir("")
    cache.keep_only(tier.name, {*committed, *listed})
    for checkpoint_id in listed:
        if checkpoint_id in sources or not is_checkpoint_id(checkpoint_id):
            continue
        if tier.exists(marker_path(checkpoint_id)):
            continue  # committed, but its marker could not be read: not usable
        if tier.exists(checkpoint_id):
            cache.warn_foreign(tier, checkpoint_id)  # a file where a checkpoint directory would be
            continue
        generations = cache.parts(tier, checkpoint_id)
        if not generations:
            continue
        # Commit order (a part's number is confirmed once its commit's is known), then time.
        newest = max(generations, key=lambda g: (generations[g][0].seq or 0, g))
        records = tuple(sorted(generations[newest], key=lambda r: r.ranks))
        if any(0 in record.ranks for record in records):
            continue  # the coordinator's node without a marker: that save never committed
        written = {rank for record in records for rank in record.ranks}
        if not set(records[0].node_ranks) <= written:
            continue  # some of this node's ranks are still writing: the part is not complete
        first = records[0]
        try:
            at = clock.written(rank_part_path(checkpoint_id, newest, first.ranks[0]))
        except FileNotFoundError:
            continue  # dropped while this looked
        copy = Copy(
            checkpoint_id,
            first.seq,
            step_of(checkpoint_id),
            at,
            newest,
            partial=True,
            confirmed=all(record.confirmed for record in records),
        )
        sources[checkpoint_id] = SeenCopy(copy, None, records)
    return sources


class _TierTimes:
    """When files of one tier were written, on this host's clock: the time the tier stamped, moved
    by how far this host's clock is from the tier's (probed once, when first needed). A part's age
    must not come from the ``written_at`` its writer's clock put in it: retention stops holding a
    part for promotion after ``stale_after``, and a trainer whose clock runs behind would make it
    look old at once."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.offset: float | None = None

    def written(self, path: str) -> float:
        if self.offset is None:
            self.offset = clock_offset(self.tier)
        return self.tier.stat(path).mtime + self.offset


def foreign_parts(tier: Tier, cache: MarkerCache | None = None) -> dict[str, dict[str, list[PartRecord]]]:
    """In a node-local tier: ``{id: {generation: rank part records}}`` of the parts this node's ranks
    wrote of saves coordinated on another node (no rank 0 part record here). Their commit is
    decided on the coordinator's node; this node learns that one was replaced only from a newer
    commit of the id that it can see (:func:`tierstore.promote.policy.superseded_parts`). With a
    ``cache``, records are read again only where their directories changed."""
    found: dict[str, dict[str, list[PartRecord]]] = {}
    if not tier.node_local:
        return found
    for checkpoint_id in tier.list_dir(""):
        if not is_checkpoint_id(checkpoint_id):
            continue
        generations = (
            part_records(tier, checkpoint_id) if cache is None else (cache.parts(tier, checkpoint_id))
        )
        for generation, records in generations.items():
            if records and not any(0 in record.ranks for record in records):
                found.setdefault(checkpoint_id, {})[generation] = records
    return found
