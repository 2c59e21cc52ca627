"""Activity records: who may still write or read a generation, known explicitly, never guessed.

Cleanup must not touch what anyone may still write or read, and file times cannot tell: temp files
and multipart uploads are invisible, a straggler rank writes late, a reader holds files open. So each
holds an activity record, ``.tierstore/activity/<kind>~<id>~<generation>~<token>.json`` (``write``,
``promote``, ``read``: docs/operations.md, "Activity records"), rewritten by :data:`HEARTBEAT` every
``ttl / 4``. Liveness compares the record's time, as the tier stamps it, with the tier's own clock
(:func:`tierstore.records.clock.tier_now`), never with this host's clock nor a pid: a sidecar in
another PID namespace, container or node judges the same way. A failed refresh is logged, and the
next one retries.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from tierstore._platform.runtime import ProcessLocal, Ticker
from tierstore.ids import ACTIVITY_DIR, activity_path, parse_activity_path
from tierstore.records.clock import tier_now
from tierstore.tiers import Tier, is_host_memory

logger = logging.getLogger(__name__)
ACTIVITY_TTL = 60.0
"""Default seconds a record stays live without a refresh (a holder refreshes it four times as often)."""
KINDS = ("write", "promote", "read", "drop")


@dataclass(frozen=True)
class ActivityInfo:
    """A record seen in a tier: what kind, on which checkpoint id and generation (None: any)."""

    kind: str
    checkpoint_id: str
    generation: str | None
    path: str
    age: float


class Activity:
    """One held record; :meth:`release` it (or use :func:`held`)."""

    def __init__(self, tier: Tier, kind: str, checkpoint_id: str, generation: str | None, ttl: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"activity kind must be one of {KINDS}, got {kind!r}")
        self.tier, self.kind = tier, kind
        self.checkpoint_id, self.generation = checkpoint_id, generation
        self.path = activity_path(kind, checkpoint_id, generation, uuid.uuid4().hex[:12])
        self.body = json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "kind": kind,
                "checkpoint_id": checkpoint_id,
                "generation": generation,
                "since": time.time(),
            }
        ).encode()
        self.released = False
        self.owner = os.getpid()
        """The process that published it: only it deletes it (a forked child's copy is inert)."""
        self.interval = ttl / 4
        self.due = 0.0
        self.made: tuple[str, ...] = ()
        """The directories its first write made (deepest first), removed again with it when empty:
        a reader leaves a tier as it found it (see :func:`hold`)."""

    def refresh(self) -> None:
        """(Re)write the record: it is live for another ``ttl`` seconds.

        A :meth:`release` that comes while this write is on its way wins: the record is deleted
        again. Otherwise the heartbeat's last write could land after the release's delete, and the
        record would look live for another ``ttl``, keeping cleanup off its generation.
        """
        self.due = time.monotonic() + self.interval
        self.tier.write_bytes(self.path, self.body)
        if self.released:  # flag set before the release deletes: one of the two deletes is last
            with contextlib.suppress(FileNotFoundError):
                self._withdraw()

    def release(self) -> None:
        """Stop refreshing and delete the record (best effort: an orphan expires by itself)."""
        if self.released:
            return
        self.released = True
        HEARTBEAT.get().forget(self)
        if os.getpid() != self.owner:
            return  # a forked child's inherited copy: the record is still the parent's
        try:
            self._withdraw()
        except Exception as exc:  # noqa: BLE001 - it expires after ACTIVITY_TTL anyway
            logger.warning("could not remove activity record %s in %s: %s", self.path, self.tier.name, exc)

    def _withdraw(self) -> None:
        """Delete the record, then each directory of :attr:`made` that is empty at that instant."""
        self.tier.delete(self.path)
        if self.made and (local := self.tier.local) is not None:
            for directory in self.made:
                local.remove_if_empty(directory)


def hold(
    tier: Tier, kind: str, checkpoint_id: str, generation: str | None, *, ttl: float = ACTIVITY_TTL
) -> Activity:
    """Publish a record and keep it live until :meth:`Activity.release`.

    Raises what the tier raises when the first write fails: work that cannot announce itself must
    not start, since cleanup could then remove it.

    A ``read`` record is written before the reader knows whether the tier holds the id at all (it
    must precede the marker read, or retention could delete the copy under it), so a restore of an
    id saved nowhere would leave ``.tierstore/activity`` (and the tier root) behind in every fresh
    tier it looked at. It notes which of those directories did not exist (a stat each, only where
    the tier has directories: nothing is asked of S3) and its release removes them again, each
    with ``rmdir``, which fails while anything is inside: a concurrent reader's or save's record
    keeps them (its holder removes none it did not make, the last one out leaves an empty
    directory: harmless). A writer whose first file is on its way into a directory just emptied
    makes it again (:func:`tierstore.tiers.durable.in_dirs`). The record itself is deleted first,
    as always, so no reader is ever unannounced while it reads. Other kinds leave their
    directories: their holders write files of their own beside them, and a save would otherwise
    make and remove the directory each time.
    """
    activity = Activity(tier, kind, checkpoint_id, generation, ttl)
    if kind == "read":
        activity.made = _absent_dirs(tier)
    activity.refresh()
    HEARTBEAT.get().keep(activity)
    return activity


def _absent_dirs(tier: Tier) -> tuple[str, ...]:
    """The directories from :data:`ACTIVITY_DIR` up to the tier root (``""``) that do not exist,
    deepest first (none on a tier without directories)."""
    local = tier.local
    if local is None:
        return ()
    parts = ACTIVITY_DIR.split("/")
    absent = []
    for depth in range(len(parts), -1, -1):
        directory = "/".join(parts[:depth])
        if local.directory_mtime(directory) is not None:
            break
        absent.append(directory)
    return tuple(absent)


@contextlib.contextmanager
def held(
    tier: Tier, kind: str, checkpoint_id: str, generation: str | None, *, ttl: float = ACTIVITY_TTL
) -> Iterator[Activity]:
    """:func:`hold` for the duration of the block."""
    activity = hold(tier, kind, checkpoint_id, generation, ttl=ttl)
    try:
        yield activity
    finally:
        activity.release()


def activities(tier: Tier, *, now: float | None = None) -> list[ActivityInfo]:
    """Every record in ``tier``, live or not (``age``: seconds since its last refresh, by the tier's
    clock unless ``now`` is given on it).

    Without ``now``, a tier that holds no record is answered by one listing, without probing its
    clock (a write, a stat, a delete: what a promoter with nothing to do would pay every pass);
    otherwise the clock is read first and the records listed again after it, so that none looks
    older than it is."""
    if now is None:
        if not any(parse_activity_path(info.path) for info in tier.find(ACTIVITY_DIR)):
            return []  # a record written since is as if written after this call returned
        now = tier_now(tier)
    found = []
    for info in tier.find(ACTIVITY_DIR):
        parsed = parse_activity_path(info.path)
        if parsed is not None:
            kind, checkpoint_id, generation = parsed
            found.append(ActivityInfo(kind, checkpoint_id, generation, info.path, now - info.mtime))
    return found


def live(tier: Tier, *, ttl: float = ACTIVITY_TTL) -> list[ActivityInfo]:
    """The records of holders still at work (refreshed within ``ttl`` seconds, by the tier's clock)."""
    return [a for a in activities(tier) if a.age < ttl]


def is_busy(records: list[ActivityInfo], checkpoint_id: str, generation: str | None) -> bool:
    """True when a live record covers ``checkpoint_id`` (and ``generation``, if one is given).

    A record without a generation (a reader that has not chosen yet) covers every generation.
    """
    return any(
        r.checkpoint_id == checkpoint_id
        and (generation is None or r.generation is None or r.generation == generation)
        for r in records
    )


class Heartbeat:
    """Refreshes every held record of this process, on one beat (a
    :class:`~tierstore._platform.runtime.Ticker`). Each tier's due records are refreshed on a
    thread of their own, and a tier whose last refresh has not answered is passed over: a tier
    that stops answering holds its own records only, never the other tiers' (their records would
    expire, and cleanup take their generations for abandoned)."""

    def __init__(self, tick: float) -> None:
        self._held: set[Activity] = set()
        self._lock = threading.Lock()
        self._busy: set[str] = set()
        """Tiers whose refresh is on its way."""
        self._ticker = Ticker("tierstore-heartbeat", tick, self._beat)

    def keep(self, activity: Activity) -> None:
        """Refresh ``activity`` until :meth:`forget`."""
        with self._lock:
            self._held.add(activity)
        self._ticker.start()

    def forget(self, activity: Activity) -> None:
        """Stop refreshing ``activity``."""
        with self._lock:
            self._held.discard(activity)

    def holding(self) -> list[Activity]:
        """The records this process refreshes now."""
        with self._lock:
            return list(self._held)

    def _beat(self) -> None:
        due: dict[str, list[Activity]] = {}
        for activity in self.holding():
            if not activity.released and time.monotonic() >= activity.due:
                due.setdefault(activity.tier.name, []).append(activity)
        for name, records in due.items():
            with self._lock:
                if name in self._busy:
                    continue
                self._busy.add(name)
            if is_host_memory(records[0].tier):  # cannot hang: no thread
                self._refresh(name, records)
            else:
                refresh = functools.partial(self._refresh, name, records)
                threading.Thread(target=refresh, name=f"tierstore-heartbeat-{name}", daemon=True).start()

    def _refresh(self, name: str, records: list[Activity]) -> None:
        try:
            for activity in records:
                try:
                    activity.refresh()
                except Exception as exc:  # noqa: BLE001 - retried at the next beat
                    logger.warning("could not refresh activity record %s in %s: %s", activity.path, name, exc)
        finally:
            with self._lock:
                self._busy.discard(name)


HEARTBEAT = ProcessLocal(lambda: Heartbeat(0.25))
"""This process's refresher (process-wide by nature: it outlives any one writer or reader). A forked
child has its own, empty: the parent's thread goes on refreshing the parent's records."""
