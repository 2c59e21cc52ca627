"""Cleaning up what no commit marker covers: uncommitted generations, incomplete writes, the records
of holders that are gone.

Only things that no marker (or, on a non-coordinator node, no part record) refers to are touched, only
once they have been left alone for ``promote.stale_after`` (by the tier's clock, never this host's:
:mod:`tierstore.records.clock`), and never a generation that a live activity record names (a save,
promotion or restore at work: see :mod:`tierstore.records.activity`), however old or invisible its
files look. Temp files and incomplete multipart uploads are found and discarded
by the tier itself (:meth:`~tierstore.tiers.base.Tier.incomplete_writes`). Committed checkpoints are
removed only by retention (:mod:`tierstore.promote.retention`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tierstore._platform.owners import owner_is_gone
from tierstore.ids import (
    CLOCK_DIR,
    COMMITS_DIR,
    MARKER_NAME,
    MIRROR_DIR,
    MIRROR_MARKER_PREFIX,
    PARTS_DIR,
    RANK0_PART,
    generation_dir,
    parse_commit_entry,
    split_generation_path,
    staging_dir,
    void_entry_path,
    writer_staging_dir,
)
from tierstore.promote.discovery import MarkerCache, SeenCopy, discover
from tierstore.records.activity import ACTIVITY_TTL, ActivityInfo, activities, is_busy
from tierstore.records.clock import tier_now
from tierstore.records.log import LogEntry, highest_in, read_log_and_voids
from tierstore.records.mirror import EXCHANGE_ENDS_DIR, exchange_ends_dir
from tierstore.records.protocol import drop, forget_entry, sweep
from tierstore.signing import MarkerTrust
from tierstore.tiers import FileInfo, IncompleteWrite, LocalFace, Tier

logger = logging.getLogger(__name__)


VOID_BELOW_TOP = "void log entry below the highest number"
"""The reason of a bookkeeping cleanup: every claim leaves one (records/protocol.py ``claim``)."""


@dataclass(frozen=True)
class Cleanup:
    """Something to remove from ``tier``: ``kind`` is ``tree``, ``file``, ``entry`` (a log entry
    holding the tier's highest number: voided, not deleted) or ``incomplete``."""

    tier: str
    kind: str
    path: str
    reason: str
    write: IncompleteWrite | None = None


def find_leftovers(
    tier: Tier,
    *,
    trust: MarkerTrust,
    stale_after: float,
    activity_ttl: float,
    now: float | None = None,
    cache: MarkerCache | None = None,
    progress: Callable[[int], None] = lambda _count: None,
) -> list[Cleanup]:
    """Everything in ``tier`` that cleanup would remove now, with the reason.

    The order of the look matters. Files are listed first, activity records second, markers last:
    a save that starts after the file listing has no files in it; one that started before holds
    its record before writing anything, and keeps it until its marker is published, so each listed
    generation is either named by a live record or by a marker as it is after the file listing,
    or truly abandoned.

    Markers come from ``cache`` (the promoter's, :class:`~tierstore.promote.discovery.MarkerCache`;
    without one, every marker is read) only where it trusts them at the mtime this look's own
    marker listing shows, made after the file listing; every other marker is read. A trusted
    entry (settled by that cache's rules, read by this promoter or by the previous keeper whose
    index seeded it) is the content the marker has for as long as it shows that mtime: a marker
    replaced after that read has a later mtime. So a marker listed at that mtime after the file
    listing holds, at the time of the listing, the manifest taken from the cache, as a marker read
    then would. The same holds of a node-local tier's part records, taken from the cache only
    while the directories they were read from, looked at now, keep their settled mtimes.

    Every age is taken on the tier's clock (``now`` defaults to
    :func:`~tierstore.records.clock.tier_now`, read before the listing): this host's clock, however
    far off, never makes a live record look expired or a file in flight look abandoned.

    ``progress(1)`` is called after each step of the look (whoever bounds it by its progress).
    """
    now = tier_now(tier) if now is None else now
    files = tier.find("")
    progress(1)
    incomplete = tier.incomplete_writes(idle_for=max(stale_after, activity_ttl), now=now)
    progress(1)
    records = activities(tier, now=now)
    progress(1)
    at_work = [r for r in records if r.age < activity_ttl]
    seen = discover(tier, MarkerCache(trust) if cache is None else cache)  # markers listed now, last
    progress(1)
    found = _uncommitted_generations(tier, files, seen, at_work, stale_after=stale_after, now=now)
    for write in incomplete:
        # Never a write of work in progress, however idle it looks (a slow part upload).
        owner = split_generation_path(write.path)
        checkpoint_id = owner[0] if owner else write.path.split("/", 1)[0]
        if is_busy(at_work, checkpoint_id, owner[1] if owner else None):
            continue
        idle = now - write.last_activity
        found.append(
            Cleanup(
                tier.name,
                "incomplete",
                write.path,
                f"{write.kind} of an interrupted write, idle {idle:.0f}s",
                write,
            )
        )
    if (local := tier.local) is not None and local.staging:  # a writer's lock is a local file
        found += _gone_owners(tier, local, stale_after=stale_after, now=now)
        progress(1)
    found += _unfinished_mirrors(tier, files, at_work, stale_after=stale_after, now=now)
    found += _orphan_log_entries(tier, files, seen, at_work, stale_after=stale_after, now=now)
    progress(1)
    found += [
        Cleanup(tier.name, "file", info.path, "clock probe of a process that stopped")
        for info in files
        if info.path.startswith(f"{CLOCK_DIR}/") and now - info.mtime >= activity_ttl
    ]
    for record in records:
        if record.age >= 2 * activity_ttl:  # not refreshed for two lifetimes: its holder is gone
            found.append(
                Cleanup(tier.name, "file", record.path, f"{record.kind} record of a holder that is gone")
            )
    return found


def _orphan_log_entries(
    tier: Tier,
    files: list[FileInfo],
    seen: dict[str, SeenCopy],
    at_work: list[ActivityInfo],
    *,
    stale_after: float,
    now: float,
) -> list[Cleanup]:
    """Commit-log entries of commits that never happened here (a failed save) or were replaced, and
    void entries below the highest number.

    The tier's highest number always stays: an orphan entry holding it is turned into a void entry
    (:func:`tierstore.records.protocol.forget_entry`), the high-water mark of the sequence. Only
    entries in the first listing (``files``, taken before the activity records were read) are
    judged: a save claims its number after announcing itself, so an entry listed then either has a
    live record among ``at_work`` or belongs to no save at work; one claimed since is left alone.
    """
    ages = {info.path: now - info.mtime for info in files if info.path.startswith(COMMITS_DIR)}
    log, voids = read_log_and_voids(tier)
    log = [entry for entry in log if entry.path in ages]
    top = max([log[-1].seq if log else 0, *voids])
    found: list[Cleanup] = [  # a claim's number stays taken a while: a racing claimant's look
        Cleanup(tier.name, "file", void_entry_path(seq), VOID_BELOW_TOP)
        for seq in voids
        if seq < top and ages.get(void_entry_path(seq), 0.0) >= stale_after
    ]
    for entry in log:
        known = seen.get(entry.checkpoint_id)
        if known is not None and known.copy.generation == entry.generation:
            continue
        if is_busy(at_work, entry.checkpoint_id, entry.generation):
            continue
        if ages.get(entry.path, 0.0) >= stale_after:
            kind = "entry" if entry.seq >= top else "file"  # the high-water mark: voided
            found.append(
                Cleanup(tier.name, kind, entry.path, "commit-log entry of a commit that is not here")
            )
    return found


def _unfinished_mirrors(
    tier: Tier, files: list[FileInfo], at_work: list[ActivityInfo], *, stale_after: float, now: float
) -> list[Cleanup]:
    """Mirrored generations without a mirror marker (an exchange cut short by a dead process),
    untouched for ``stale_after``: a mirror exists only where its marker is. Never one that a
    receiving exchange announces (its ``write`` record), however long it has been quiet."""
    newest: dict[str, float] = {}
    marked: set[str] = set()
    for info in files:
        parts = info.path.split("/")
        if info.path.startswith(f"{MIRROR_DIR}/") and len(parts) == 5:
            directory = "/".join(parts[:4])
            newest[directory] = max(newest.get(directory, 0.0), info.mtime)
            if parts[4].startswith(MIRROR_MARKER_PREFIX):
                marked.add(directory)
    return [
        Cleanup(
            tier.name,
            "tree",
            directory,
            f"peer mirror without a mirror marker; untouched for {now - mtime:.0f}s",
        )
        for directory, mtime in sorted(newest.items())
        if directory not in marked
        and now - mtime >= stale_after
        and not is_busy(at_work, *directory.split("/")[2:4])
    ]


def _gone_owners(tier: Tier, local: LocalFace, *, stale_after: float, now: float) -> list[Cleanup]:
    """Directories of processes that are gone, locked by their owners (:mod:`tierstore._platform.owners`):
    writers' staging directories, and trainers' exchange-end record directories (PROCESS-mode mirror
    waits, :mod:`tierstore.records.mirror`). One without a lock (a record that arrived after its
    trainer closed) once untouched for ``stale_after``, a staging one only if its pid is gone too."""
    found: list[Cleanup] = []
    owned: list[tuple[str, str | None, str]] = [
        (writer_staging_dir(o), o, "staging buffers of a writer") for o in tier.list_dir(staging_dir())
    ]
    waits = tier.list_dir(EXCHANGE_ENDS_DIR)
    owned += [(exchange_ends_dir(w), None, "exchange-end records of a trainer") for w in waits]
    for directory, owner, what in owned:
        alive = local.owner_alive(directory)
        if alive is None:  # a directory without a lock: judge by pid (this host only) and age
            touched = local.directory_mtime(directory)
            if touched is None:
                continue
            alive = not ((owner is None or owner_is_gone(owner)) and now - touched >= stale_after)
        if not alive:
            found.append(Cleanup(tier.name, "tree", directory, f"{what} process that is gone"))
    return found


def _uncommitted_generations(
    tier: Tier,
    files: list[FileInfo],
    seen: dict[str, SeenCopy],
    at_work: list[ActivityInfo],
    *,
    stale_after: float,
    now: float,
) -> list[Cleanup]:
    newest: dict[tuple[str, str], float] = {}
    with_parts: set[tuple[str, str]] = set()
    coordinators: set[tuple[str, str]] = set()
    marked: set[str] = set()
    for info in files:
        split = split_generation_path(info.path)
        if split is None:
            owner, _, name = info.path.partition("/")
            if name == MARKER_NAME:
                marked.add(owner)
            continue
        checkpoint_id, generation, rest = split
        key = (checkpoint_id, generation)
        newest[key] = max(newest.get(key, 0.0), info.mtime)
        if rest.split("/", 1)[0] == PARTS_DIR:
            with_parts.add(key)
            if rest == f"{PARTS_DIR}/{RANK0_PART}":
                coordinators.add(key)
    found: list[Cleanup] = []
    for (checkpoint_id, generation), mtime in sorted(newest.items()):
        known = seen.get(checkpoint_id)
        if known is not None and known.copy.generation == generation:
            continue
        if checkpoint_id in marked and known is None:
            continue  # a marker we could not read this time: its data is not ours to judge
        if is_busy(at_work, checkpoint_id, generation):
            continue  # someone may still write (or read) it
        key = (checkpoint_id, generation)
        if tier.node_local and key in with_parts and key not in coordinators:
            # Another node's part: its commit is only visible on the coordinator's node, so a
            # committed part looks like a failed one here; retention decides (see policy).
            continue
        idle = now - mtime
        if idle >= stale_after:
            why = "generation not named by the marker" if known else "no commit marker"
            found.append(
                Cleanup(
                    tier.name,
                    "tree",
                    generation_dir(checkpoint_id, generation),
                    f"{why}; untouched for {idle:.0f}s",
                )
            )
    return found


def remove(tier: Tier, cleanup: Cleanup, *, trust: MarkerTrust, activity_ttl: float = ACTIVITY_TTL) -> None:
    """Carry out one cleanup (an uncommitted generation: see :func:`remove_generation`). The
    tier's change stamp follows every removal (the protocol's own for generations and log
    entries: :mod:`tierstore.records.changes`)."""
    split = split_generation_path(f"{cleanup.path}/x")
    if cleanup.kind == "tree" and split is not None:
        remove_generation(tier, split[0], split[1], trust=trust, activity_ttl=activity_ttl)
    elif cleanup.kind == "entry" and (parsed := parse_commit_entry(cleanup.path)) is not None:
        forget_entry(tier, LogEntry(*parsed), top=highest_in(tier))
    else:
        write = cleanup.write if cleanup.kind == "incomplete" else None
        sweep(tier, cleanup.path, tree=cleanup.kind == "tree", write=write)


def remove_generation(
    tier: Tier, checkpoint_id: str, generation: str, *, trust: MarkerTrust, activity_ttl: float = ACTIVITY_TTL
) -> bool:
    """Remove an uncommitted generation, unless someone commits it meanwhile; True if removed.

    The protocol's drop (:func:`tierstore.records.protocol.drop`): in a job-wide tier another node's
    promoter may publish a marker over files that were already there when cleanup looked (the last
    node's part completes a multi-node promotion), so its part records go first, which a promoter
    needs in order to publish; then the tier is asked again for a marker naming the generation and
    for work in progress on it; only if there is neither does the data go. A promoter that starts
    later finds no records to publish from and copies its part again; one at work holds a record.
    """
    return drop(tier, checkpoint_id, generation, trust=trust, committed=False, ttl=activity_ttl)


__all__ = ["Cleanup", "find_leftovers", "remove", "remove_generation"]
