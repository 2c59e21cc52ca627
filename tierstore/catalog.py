"""What is committed where, decided by markers (never by directories), and which checkpoint is newest.

**Newest** is commit order: the sequence number each commit takes (:mod:`tierstore.commits`), read
from the commit logs of every tier in one listing each. Never the step in the id, never a clock:
after a rollback the new saves are newer than the abandoned higher steps, and ``final`` or
``step100_20240601`` order as committed. The step stays metadata, for display and ``keep_every``.
Copies from before the commit log (tierstore 0.1.0) are ordered by the ``seq`` in their marker.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierstore.commits import LogEntry, read_log
from tierstore.config import Config, as_config
from tierstore.ids import MARKER_NAME, is_checkpoint_id, newest_first
from tierstore.manifest import Manifest, read_manifest
from tierstore.tiers import Tier
from tierstore.topology import current_node

logger = logging.getLogger(__name__)


def marker_times(tier: Tier) -> dict[str, float]:
    """``{checkpoint id: marker mtime}`` for every id committed in ``tier`` (one listing)."""
    return {
        child: info.mtime
        for child, info in tier.find_in_children(MARKER_NAME).items()
        if is_checkpoint_id(child)
    }


def _committed_seq(tier: Tier, checkpoint_id: str, entries: list[LogEntry]) -> int | None:
    """The logged sequence number of the generation ``tier``'s marker names.

    One entry is the commit itself. Several (an overwrite, or one that failed after claiming its
    number) need the marker to say which generation is committed: a failed overwrite's number must
    not make the id look newer than it is.
    """
    if len(entries) == 1:
        return entries[0].seq
    try:
        generation = read_manifest(tier, checkpoint_id).generation
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

    def scan(self) -> dict[str, dict[str, float]]:
        """``{id: {tier name: marker mtime}}`` for every committed copy (tiers listed in parallel)."""
        with ThreadPoolExecutor(len(self.tiers)) as pool:
            per_tier = list(pool.map(marker_times, self.tiers))
        merged: dict[str, dict[str, float]] = {}
        for tier, found in zip(self.tiers, per_tier, strict=True):
            for checkpoint_id, mtime in found.items():
                merged.setdefault(checkpoint_id, {})[tier.name] = mtime
        return merged

    def sequences(self, scanned: dict[str, dict[str, float]]) -> dict[str, int | None]:
        """``{id: its commit sequence}`` for the scanned ids: the highest logged for that id in a
        tier holding its marker; for unlogged (older) copies, the ``seq`` in the marker."""
        with ThreadPoolExecutor(len(self.tiers)) as pool:
            logs = dict(
                zip((t.name for t in self.tiers), pool.map(read_log, self.tiers), strict=True)
            )
        by_name = {t.name: t for t in self.tiers}
        found: dict[str, int | None] = {}
        for tier_name, log in logs.items():
            per_id: dict[str, list[LogEntry]] = {}
            for entry in log:
                if tier_name in scanned.get(entry.checkpoint_id, {}):
                    per_id.setdefault(entry.checkpoint_id, []).append(entry)
            for checkpoint_id, entries in per_id.items():
                seq = _committed_seq(by_name[tier_name], checkpoint_id, entries)
                if seq is not None:
                    found[checkpoint_id] = max(found.get(checkpoint_id) or 0, seq)
        for checkpoint_id in scanned.keys() - found.keys():
            found[checkpoint_id] = None
            for tier_name in scanned[checkpoint_id]:
                try:
                    found[checkpoint_id] = read_manifest(by_name[tier_name], checkpoint_id).seq
                    break
                except Exception:  # noqa: BLE001, S112 - a bad marker: another tier may do
                    continue
        return found

    def newest_first(self, scanned: dict[str, dict[str, float]]) -> list[str]:
        """The scanned ids, newest first (see the module docstring)."""
        return newest_first(self.sequences(scanned).items())

    def latest(self) -> str | None:
        """The newest id with a valid marker in any tier, or None."""
        return next(self.candidates(), None)

    def candidates(self) -> Iterator[str]:
        """Ids with a valid marker in some tier, newest first, in the order :meth:`newest_first`
        gives them; without listing any data file (a whole-namespace listing costs a request per
        1000 objects: every rank's files of every checkpoint, in S3).

        Each tier is asked for two short listings: its commit log (one entry per commit) and its
        top-level ids. An id a tier holds without a log entry there (a copy from before the commit
        log, a promotion that stopped between its marker and its entry) has its marker read at
        once, for the ``seq`` in it. Every other marker is read lazily, newest entry first: the
        first entry whose marker is there and names its generation places the id (the highest
        sequence of any tier holding it, as :meth:`sequences` decides). A damaged marker is
        skipped with a warning; a missing one (a save in progress, a failed or deleted commit) is
        not a copy.
        """
        with ThreadPoolExecutor(len(self.tiers)) as pool:
            orders = list(pool.map(_CommitOrder, self.tiers))
        pending = sorted(
            ((seq, checkpoint_id, i, generation)
             for i, order in enumerate(orders) for seq, checkpoint_id, generation in order.items),
            key=lambda item: (item[0] is not None, item[0] or 0, item[1]),
            reverse=True,
        )  # fmt: skip
        placed: set[str] = set()
        for _seq, checkpoint_id, i, generation in pending:
            if checkpoint_id in placed or not orders[i].holds(checkpoint_id, generation):
                continue
            placed.add(checkpoint_id)
            yield checkpoint_id

    def listings(self) -> list[Listing]:
        """Every committed checkpoint, newest first, with sizes and timings from its markers."""
        scanned = self.scan()
        by_name = {t.name: t for t in self.tiers}
        jobs = [(i, name) for i, tiers in scanned.items() for name in tiers]

        def load(job: tuple[str, str]) -> Manifest | None:
            try:
                return read_manifest(by_name[job[1]], job[0])
            except Exception as exc:  # noqa: BLE001 - listed as unusable rather than failing ls
                logger.warning("ignoring marker of %s in %s: %s", job[0], job[1], exc)
                return None

        with ThreadPoolExecutor(16) as pool:
            manifests = dict(zip(jobs, pool.map(load, jobs), strict=True))
        listings = []
        for checkpoint_id in self.newest_first(scanned):
            held = [n for n in by_name if manifests.get((checkpoint_id, n)) is not None]
            if not held:
                continue
            first = manifests[(checkpoint_id, held[0])]
            assert first is not None
            timings = dict(first.timings)
            lags = [
                m.timings.get("durable_lag_s") for n in held if (m := manifests[(checkpoint_id, n)])
            ]
            if any(lag is not None for lag in lags):
                timings["durable_lag_s"] = min(lag for lag in lags if lag is not None)
            original = min(
                float((m.provenance or {}).get("first_committed_at", m.committed_at))
                for n in held
                if (m := manifests[(checkpoint_id, n)]) is not None
            )
            listings.append(
                Listing(
                    checkpoint_id,
                    tuple(held),
                    first.total_bytes,
                    original,
                    first.step,
                    timings,
                )
            )
        return listings


class _CommitOrder:
    """One tier's commits, for :meth:`Catalog.candidates`: log entries, unlogged markers, and the
    markers read so far (each at most once)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        log = read_log(tier)
        self.entries = Counter(e.checkpoint_id for e in log)
        self.markers: dict[str, Manifest | None] = {}
        unlogged = [c for c in tier.list_dir("") if is_checkpoint_id(c) and c not in self.entries]
        if unlogged:  # many only in a tier written before the commit log: read in parallel
            with ThreadPoolExecutor(min(16, len(unlogged))) as pool:
                found = list(pool.map(self._read, unlogged))
            self.markers.update(zip(unlogged, found, strict=True))
        self.items: list[tuple[int | None, str, str | None]] = [
            (e.seq, e.checkpoint_id, e.generation) for e in log
        ] + [(m.seq, c, None) for c in unlogged if (m := self.markers[c]) is not None]

    def marker(self, checkpoint_id: str) -> Manifest | None:
        """The tier's marker of ``checkpoint_id``; None when absent or unreadable (warned)."""
        if checkpoint_id not in self.markers:
            self.markers[checkpoint_id] = self._read(checkpoint_id)
        return self.markers[checkpoint_id]

    def _read(self, checkpoint_id: str) -> Manifest | None:
        try:
            return read_manifest(self.tier, checkpoint_id)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - a bad marker is skipped, with a warning
            logger.warning("ignoring marker of %s in %s: %s", checkpoint_id, self.tier.name, exc)
            return None

    def holds(self, checkpoint_id: str, generation: str | None) -> bool:
        """True when this tier's marker of the id is valid and the entry (``generation``; None for
        an unlogged marker) is its commit: the only entry of the id, or the one of its generation."""
        manifest = self.marker(checkpoint_id)
        if manifest is None:
            return False
        single = self.entries[checkpoint_id] == 1
        return generation is None or single or manifest.generation == generation
