"""The commit protocol's one executor: every actor that commits, drops, confirms or sweeps calls here.

A checkpoint exists in a tier only where its marker is. The writer (a save), the promotion job,
retention, cleanup and the peer-mirror exchange change what is committed only through the operations
below, each local to one tier (it asks no other tier). Each builds an operation of the state machine
(:mod:`tierstore.records.machine`, where every rule and ordering lives) and :func:`run` carries it
out: it asks ``decide`` what to do, performs the effects in order with tier verbs, with a kill point
between any two (``protocol.effect``, subject ``<Effect>/<id>``, beside the protocol's named ones),
and answers each asking effect with its outcome. After an operation that changes what a promoter
lists, the tier's change stamp is rewritten once, also when it raised part-way
(:mod:`tierstore.records.changes`).

* :func:`claim`, :func:`renumber` — a commit number, create-only.
* :func:`publish` — the one order for publishing a marker.
* :func:`drop` — the one order for dropping a generation; :func:`forget_entry`.
* :func:`confirm_part`, :func:`record_parts`, :func:`settle_parts` — part records of multi-node saves.
* :func:`discard`, :func:`sweep` — what a failed actor wrote, and cleanup's leftovers.
* :func:`land_mirror`, :func:`drop_mirror` — peer mirrors at rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from tierstore._platform.killpoints import kill_point
from tierstore.errors import IntegrityError, TierstoreError, TierUnavailableError
from tierstore.ids import (
    HEAD_PATH,
    INTERNAL_DIR,
    MARKER_NAME,
    MIRROR_MARKER_PREFIX,
    checkpoint_file,
    commit_entry_path,
    generation_dir,
    is_checkpoint_id,
    marker_path,
    mirror_commit_path,
    mirror_copy_path,
    mirror_id_dir,
    mirror_marker_path,
    parts_dir,
    void_entry_path,
)
from tierstore.records import machine as m
from tierstore.records.activity import ACTIVITY_TTL, Activity, activities, hold, is_busy, live
from tierstore.records.changes import touch
from tierstore.records.log import Head, LogEntry, read_head, read_log_and_voids
from tierstore.records.machine import Verdict, judge_promotion
from tierstore.records.marker import Manifest, copy_problems, read_manifest, size_problem
from tierstore.records.mirror import MirrorMarker, Recycle, held_mirrors
from tierstore.records.parts import PartRecord, generation_parts
from tierstore.signing import MarkerTrust
from tierstore.tiers import IncompleteWrite, Tier

logger = logging.getLogger(__name__)

_NAMED_KILL_POINTS: dict[str, Callable[[str], None]] = {
    "marker.files_checked": lambda subject: kill_point("marker.files_checked", subject),
    "marker.published": lambda subject: kill_point("marker.published", subject),
    "marker.rechecked": lambda subject: kill_point("marker.rechecked", subject),
    "drop.marker_withdrawn": lambda subject: kill_point("drop.marker_withdrawn", subject),
    "drop.records_dropped": lambda subject: kill_point("drop.records_dropped", subject),
}


def run(tier: Tier, op: m.Op, *, trust: MarkerTrust | None = None, recycle: Recycle | None = None) -> Any:
    """Carry out ``op`` in ``tier``: its result, or what it raises (a tier's own error as raised).
    ``trust``: the markers it reads (an operation that reads one without it fails: TypeError).
    ``recycle``: offered each file of a dropped mirror first (:func:`drop_mirror`)."""
    view, event = m.start(op, tier.describe())
    subject = op.checkpoint_id
    changed = False
    held: list[Activity] = []
    try:
        while True:
            for effect in m.decide(view, event):
                if isinstance(effect, m.Done):
                    return effect.value
                if isinstance(effect, m.Fail):
                    raise effect.error
                if isinstance(effect, m.KillPoint):
                    _NAMED_KILL_POINTS[effect.name](subject)
                    continue
                kill_point("protocol.effect", f"{type(effect).__name__}/{subject}")
                changed = changed or effect.changes
                outcome = _perform(tier, effect, trust, recycle, held)
                if effect.asks:
                    assert outcome is not None, effect
                    event = outcome
                    view = m.observe(view, event)
                    break
            else:
                raise AssertionError(f"{type(op).__name__}: decide() ended without a result or a question")
    finally:
        for activity in held:
            activity.release()
        if op.stamp is m.Stamp.ALWAYS or (op.stamp is m.Stamp.IF_CHANGED and changed):
            with _quietly(getattr(op, "quiet", False)):
                touch(tier)


@contextlib.contextmanager
def _quietly(quiet: bool) -> Iterator[None]:
    if not quiet:
        yield
        return
    with contextlib.suppress(Exception):
        yield


def _perform(
    tier: Tier, effect: m.Effect, trust: MarkerTrust | None, recycle: Recycle | None, held: list[Activity]
) -> m.Event | None:
    """One effect, with tier verbs; the event an asking effect is answered with. ``held``: the
    activity records the operation announced, released when it ends."""
    if isinstance(effect, m.ListLog):
        entries, voids = read_log_and_voids(tier, above=effect.above)
        return m.LogListed(tuple(entries), tuple(voids), effect.purpose)
    if isinstance(effect, m.PutVoid):
        try:
            tier.publish(void_entry_path(effect.seq), effect.body, create_only=True)
        except FileExistsError:
            return m.VoidPut(effect.seq, won=False)
        return m.VoidPut(effect.seq, won=True)
    if isinstance(effect, m.KeepVoid):
        tier.publish(void_entry_path(effect.seq), b"", create_only=False)
    elif isinstance(effect, m.PutEntry):
        path = commit_entry_path(effect.seq, effect.checkpoint_id, effect.generation)
        tier.publish(path, b"", create_only=effect.create_only)
    elif isinstance(effect, m.DeleteEntry):
        tier.delete(effect.entry.path)
    elif isinstance(effect, m.RaiseHead):
        _raise_head(tier, effect.seq)
    elif isinstance(effect, m.CheckFiles):
        return m.FilesChecked(tuple(_files_problems(tier, effect.manifest, effect.node)), effect.purpose)
    elif isinstance(effect, m.CheckSizes):
        found = (size_problem(tier, path, entry) for path, entry in effect.files)
        return m.FilesChecked(tuple(p for p in found if p is not None), effect.purpose)
    elif isinstance(effect, m.ReadMarker):
        if trust is None:
            raise TypeError(f"{effect!r} needs the reader's MarkerTrust: run(..., trust=)")
        return m.MarkerRead(_read_marker(tier, effect.checkpoint_id, effect.tolerate, trust), effect.purpose)
    elif isinstance(effect, m.PutMarker):
        return _put_marker(tier, effect.manifest, create_only=effect.create_only)
    elif isinstance(effect, m.DeleteMarker):
        tier.delete(marker_path(effect.checkpoint_id))
    elif isinstance(effect, m.DeleteParts):
        tier.delete_tree(parts_dir(effect.checkpoint_id, effect.generation))
    elif isinstance(effect, m.ReadActivities):
        records = [a for a in activities(tier) if a.age < effect.ttl and (a.kind == "drop") == effect.drops]
        return m.InUse(
            is_busy(records, effect.checkpoint_id, effect.generation), "drops" if effect.drops else ""
        )
    elif isinstance(effect, m.Announce):
        held.append(hold(tier, effect.kind, effect.checkpoint_id, effect.generation, ttl=effect.ttl))
    elif isinstance(effect, m.DeleteData):
        tier.delete_tree(generation_dir(effect.checkpoint_id, effect.generation))
        if (local := tier.local) is not None:  # unless another generation (an overwrite) is there
            local.remove_if_empty(effect.checkpoint_id)
    elif isinstance(effect, m.ListParts):
        return m.PartsListed(tuple(generation_parts(tier, effect.checkpoint_id, effect.generation)))
    elif isinstance(effect, m.PutBytes):
        tier.write_bytes(effect.path, effect.data)
    elif isinstance(effect, m.PutRecord):
        tier.publish(effect.path, effect.data, create_only=False)
    elif isinstance(effect, m.CheckPart):
        return m.PartChecked(_any_missing(tier, effect.record))
    elif isinstance(effect, m.DeleteFile):
        with _quietly(effect.quiet):
            tier.delete(effect.path)
    elif isinstance(effect, m.DeleteTree):
        tier.delete_tree(effect.path)
    elif isinstance(effect, m.DiscardIncomplete):
        tier.discard_incomplete(effect.write)
    elif isinstance(effect, m.RemoveIfEmpty):
        with _quietly(effect.quiet):
            if (local := tier.local) is not None:
                local.remove_if_empty(effect.path)
    elif isinstance(effect, m.MirrorInUse):
        return _mirror_in_use(tier, effect)
    elif isinstance(effect, m.DropMirrorFiles):
        _drop_mirror_files(tier, effect.checkpoint_id, effect.generation, recycle)
    else:
        raise AssertionError(f"no tier verb performs {effect!r}")
    return None


def _raise_head(tier: Tier, seq: int) -> None:
    """Keep ``tier``'s head record at least ``seq`` (:class:`~tierstore.records.machine.RaiseHead`): one read,
    and a write when the record is lower (a promotion carries a lower, older number down). Made
    when missing or damaged from one listing of the log and one of the markers (once per tier),
    ``logged`` when every marker found has an entry. Best effort: two writers racing may leave
    the lower number, and a failure is logged, never raised: the record is a hint
    (:mod:`tierstore.records.log`)."""
    try:
        head = read_head(tier)
        if seq <= 0 or (head is not None and head.seq >= seq):
            return
        if head is None:
            entries, voids = read_log_and_voids(tier)
            named = {e.checkpoint_id for e in entries}
            marked = {
                c for c in tier.find_in_children(MARKER_NAME, besides=INTERNAL_DIR) if is_checkpoint_id(c)
            }
            head = Head(max([seq, *voids, *(e.seq for e in entries)]), marked <= named)
        tier.publish(HEAD_PATH, dataclasses.replace(head, seq=max(head.seq, seq)).encode(), create_only=False)
    except (TierstoreError, OSError) as exc:
        logger.warning("tier %s: its head record was not raised to %d: %s", tier.describe(), seq, exc)


def _files_problems(tier: Tier, manifest: Manifest, node: int | None) -> list[str]:
    here = [f for f in manifest.files if not tier.node_local or node is None or f.node == node]
    return copy_problems(tier, manifest, verify=False, entries=here)


def _read_marker(tier: Tier, checkpoint_id: str, tolerate: m.Tolerate, trust: MarkerTrust) -> m.Seen:
    try:
        manifest = read_manifest(tier, checkpoint_id, trust=trust)
    except FileNotFoundError:
        if tolerate is m.Tolerate.NOTHING:
            raise
        return m.NO_MARKER
    except IntegrityError:
        if tolerate is not m.Tolerate.ALL:
            raise
        return m.Seen("")
    return m.Seen(manifest.generation, manifest.seq, manifest)


def _put_marker(tier: Tier, manifest: Manifest, *, create_only: bool) -> m.MarkerPut:
    ckpt = manifest.checkpoint_id
    try:
        tier.publish(marker_path(ckpt), manifest.to_json(), create_only=create_only)
    except FileExistsError:
        return m.MarkerPut(taken=True)
    except TierUnavailableError as exc:
        # The marker may stand although its PUT failed (the store did it, then answered an error).
        raise TierUnavailableError(
            f"{ckpt}: the commit's outcome in tier {tier.describe()} is unknown: {exc}; `tierstore"
            f" ls` and `tierstore verify {ckpt}` tell whether it is committed",
            tier=exc.tier,
        ) from exc
    return m.MarkerPut(taken=False)


def _any_missing(tier: Tier, record: PartRecord) -> bool:
    for entry in record.files:
        try:
            tier.stat(checkpoint_file(record.checkpoint_id, entry.path))
        except FileNotFoundError:
            return True
    return False


def _mirror_in_use(tier: Tier, effect: m.MirrorInUse) -> m.InUse:
    if any(held.generation == effect.generation for held in held_mirrors(tier, effect.checkpoint_id)):
        return m.InUse(True, m.MIRROR_SHARED)
    readers = [a for a in live(tier, ttl=effect.ttl) if a.kind == "read"]
    if is_busy(readers, effect.checkpoint_id, None):
        return m.InUse(True, m.MIRROR_READ)
    return m.InUse(False)


def _drop_mirror_files(tier: Tier, checkpoint_id: str, generation: str, recycle: Recycle | None) -> None:
    directory = f"{mirror_id_dir(checkpoint_id)}/{generation}"
    if recycle is not None:
        for info in tier.find(directory):
            if not info.path.rsplit("/", 1)[-1].startswith(MIRROR_MARKER_PREFIX):
                recycle(info.path, info.size)
    tier.delete_tree(directory)
    if (local := tier.local) is not None:
        local.remove_if_empty(mirror_id_dir(checkpoint_id))


# ---------------------------------------------------------------------------------------------------
# The operations, as actors call them.


def claim(tier: Tier, checkpoint_id: str, generation: str, *, floor: int = 0) -> int:
    """Take the next commit number after ``max(the tier's highest, floor)`` for this generation:
    create-only as its void entry ``<seq>~void`` (two writers never take one number in a tier,
    whatever their ids), then named by ``<seq>~<id>~<generation>``. ``floor`` is what the caller
    knows beyond this tier; only the log above it is listed. Cleanup removes the void once a higher
    number is taken. Raises ``RuntimeError`` after 64 numbers taken by others in a row."""
    number: int = run(tier, m.Claim(checkpoint_id, generation, floor))
    return number


def renumber(tier: Tier, checkpoint_id: str, generation: str, *, claimed: int, known: int) -> int:
    """The number a save commits with: ``claimed`` at its plan, unless a higher one was taken in
    ``tier`` since, or ``known`` (the highest its process knows elsewhere) reached it: then a new
    one (:class:`~tierstore.records.machine.Renumber`)."""
    number: int = run(tier, m.Renumber(checkpoint_id, generation, claimed, known))
    return number


def publish(
    tier: Tier,
    manifest: Manifest,
    *,
    trust: MarkerTrust,
    replace: bool,
    node: int | None = None,
    log: bool = True,
    ttl: float = ACTIVITY_TTL,
    expect: str | None = None,
) -> Manifest | None:
    """Commit ``manifest`` in ``tier`` (the order: :mod:`tierstore.records.machine`); None when
    published.

    ``replace=False`` publishes create-only: if the id already has a marker, nothing changes and that
    marker's manifest is returned for the caller to judge. ``replace=True`` swaps the marker
    atomically and drops the generation it named once the new one stands. ``node``: in a node-local
    tier, only that node's files are checked. ``log=False`` when the number was claimed in this tier
    already (a save). ``expect`` (with ``replace``): the generation the caller judged the marker to
    name; if another publisher swapped it since, nothing is published and the standing marker is
    returned (``FileNotFoundError`` when it was dropped). ``trust``: the standing markers read.
    Raises :class:`IntegrityError` naming the missing files."""
    standing: Manifest | None = run(tier, m.Publish(manifest, replace, node, log, ttl, expect), trust=trust)
    return standing


def drop(
    tier: Tier,
    checkpoint_id: str,
    generation: str,
    *,
    trust: MarkerTrust,
    committed: bool = True,
    ttl: float = ACTIVITY_TTL,
) -> bool:
    """Drop one generation of ``checkpoint_id`` (the order: :mod:`tierstore.records.machine`).

    ``committed=False`` drops only an uncommitted generation (cleanup, a failed save): a marker naming
    it, or one that cannot be read (or ``trust`` refuses), keeps everything. True when its data went;
    False when a marker naming it or live work on it kept the data, which cleanup removes once that is
    over. Only this generation: another one of the id may be an overwrite in flight."""
    gone: bool = run(tier, m.Drop(checkpoint_id, generation, committed, ttl), trust=trust)
    return gone


def forget_entry(tier: Tier, entry: LogEntry, *, top: int) -> None:
    """Remove a log entry whose commit does not stand; the tier's highest number ``top`` is kept as
    a void entry first (the sequence never goes back)."""
    run(tier, m.Forget(entry, top))


def confirm_part(tier: Tier, checkpoint_id: str, generation: str, seq: int | None) -> bool:
    """Rewrite this node's rank part records of ``generation`` with its commit's final number
    (``confirmed``); True when a record changed. The coordinator may have taken a new number at its
    commit; until then the records hold the one claimed when the save was planned."""
    changed: bool = run(tier, m.Confirm(checkpoint_id, generation, seq))
    return changed


def record_parts(
    tier: Tier,
    checkpoint_id: str,
    writes: list[tuple[str, bytes]],
    *,
    log: LogEntry | None = None,
    listed: bool = True,
) -> None:
    """Write part records (or a promotion's intent) whole, then log ``log``'s number. ``listed``:
    the tier's promoter lists them (node-local tiers): its change stamp follows."""
    run(tier, m.RecordParts(checkpoint_id, tuple(writes), log, listed))


def discard(
    tier: Tier,
    checkpoint_id: str,
    paths: list[str],
    *,
    dirs: tuple[str, ...] = (),
    quiet: bool = False,
    listed: bool = True,
) -> None:
    """Remove what an actor wrote of a generation that did not commit, then ``dirs`` if empty.
    ``quiet``: failures are skipped (leftovers are cleanup's). ``listed``: stamp the tier after."""
    run(tier, m.Discard(checkpoint_id, tuple(paths), dirs, quiet, listed))


def sweep(tier: Tier, path: str, *, tree: bool = False, write: IncompleteWrite | None = None) -> None:
    """Cleanup's removal of one leftover that names no commit: a tree, an incomplete write, a file."""
    run(tier, m.Sweep(path, tree, write))


def land_mirror(tier: Tier, committed: bytes, marker: MirrorMarker) -> None:
    """On the holder: the copy of the commit marker, then the mirror marker **last** (a mirror
    exists only where its marker is), after every file it names was received and verified; the files
    are checked before and again after, and a marker over a hole is withdrawn
    (:class:`IntegrityError` naming the files)."""
    ckpt, gen = marker.checkpoint_id, marker.generation
    files = tuple((mirror_copy_path(ckpt, e.path), e) for e in marker.files)
    marker_at = mirror_marker_path(ckpt, gen, marker.owner_node)
    land = m.MirrorLand(
        ckpt, marker.owner_node, mirror_commit_path(ckpt, gen), committed, marker_at, marker.to_json(), files
    )
    run(tier, land)


def drop_mirror(
    tier: Tier, checkpoint_id: str, generation: str, owner_node: int, *, recycle: Recycle | None, ttl: float
) -> str:
    """Retire one mirror: its marker first, then its generation's files unless another owner's
    mirror names the generation or a restore reads the id; '' when the files went, else why not."""
    marker_at = mirror_marker_path(checkpoint_id, generation, owner_node)
    kept: str = run(tier, m.MirrorDrop(checkpoint_id, generation, marker_at, ttl), recycle=recycle)
    return kept


def restamp(tier: Tier) -> None:
    """Rewrite the tier's change stamp (a predecessor may have died between a change and its own)."""
    run(tier, m.Restamp())


def settle_parts(
    tier: Tier,
    outcomes: list[tuple[str, str, int | None]],
    *,
    current: tuple[str, str, int | None] | None = None,
    ttl: float,
    trust: MarkerTrust,
) -> None:
    """What a node other than the coordinator's learns at a save's plan (it never sees the marker):

    * ``outcomes``, ``(id, generation, seq)`` of the coordinator process's recent saves: its parts of
      a committed one are confirmed with the final number, its parts of one that failed or that an
      overwrite replaced and dropped (``seq`` None) are dropped;
    * ``current``, ``(id, generation, seq)`` of the marker of the id being saved in the coordinator's
      tier (generation '' when there is none): its parts of that generation are confirmed. Nothing
      is dropped on its account: another generation may belong to a save still in flight.
    """
    held: dict[str, list[str]] = {}  # the coordinator repeats its outcomes: act on what is here
    for checkpoint_id, generation, seq in outcomes:
        if checkpoint_id not in held:
            held[checkpoint_id] = tier.list_dir(checkpoint_id)
        if generation not in held[checkpoint_id]:
            continue
        if seq is None:
            drop(tier, checkpoint_id, generation, trust=trust, committed=False, ttl=ttl)
        else:
            confirm_part(tier, checkpoint_id, generation, seq)
    if current is not None and current[1]:
        confirm_part(tier, *current)


__all__ = [
    "Verdict",
    "claim",
    "confirm_part",
    "discard",
    "drop",
    "drop_mirror",
    "forget_entry",
    "judge_promotion",
    "land_mirror",
    "publish",
    "record_parts",
    "renumber",
    "restamp",
    "run",
    "settle_parts",
    "sweep",
]
