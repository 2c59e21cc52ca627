"""The commit protocol's decisions, in one pure state machine: ``decide(view, event) -> effects``.

Every change to what a tier holds as committed — a number claimed, a marker published or withdrawn, a
log entry written or forgotten, a part record written or confirmed, a mirror marker, a generation
dropped, leftovers swept — is one *operation* (:data:`Op`) run by the one executor
(:mod:`tierstore.records.protocol`). The executor knows no rule: it asks :func:`decide` what to do,
performs the effects in order (a kill point between any two), and answers the asking effect with the
next :data:`Event`, which :func:`observe` folds into the :class:`View` (what the operation knows so
far). Both are pure: no I/O, no clock, no tier. The model-based tests (``tests/records``) drive them
directly and interleave the effects of concurrent actors.

An effect that *asks* (a read, or a write whose outcome decides what follows) is always the last of its
list. Effects that only write never ask: their failures reach the operation's caller as the tier raised
them. The ordering rules of claim, publish and drop are docs/design.md, "The commit protocol"; each is
written once here, with a test that fails when it breaks. Beyond what it says: a replacing marker's
number is logged before the marker, after the replaced generation's own; a logging publish raises the
head record before its marker (a cut before its entry shows there). **mirror**: its files checked, the owner's
marker copied, the mirror marker last, checked again; retired marker first, files only when no other
owner's mirror names them and no restore reads them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from tierstore.errors import IntegrityError
from tierstore.ids import is_newer_commit, rank_part_path
from tierstore.records.log import LogEntry
from tierstore.records.marker import FileEntry, Manifest
from tierstore.records.parts import PartRecord
from tierstore.tiers import IncompleteWrite

CLAIM_ATTEMPTS = 64
"""Numbers taken by others in a row before a claim gives up."""


class Stamp(enum.Enum):
    """When the executor rewrites the tier's change stamp (:mod:`tierstore.records.changes`)."""

    ALWAYS = "after the run, also one that raised part-way (a change may have happened)"
    IF_CHANGED = "after a run that wrote or deleted something"
    NEVER = "the records it changes are not in a promoter's listing"


# ---------------------------------------------------------------------------------------------------
# Operations: what an actor asks of the protocol.


@dataclass(frozen=True)
class Claim:
    """Take the next commit number after ``max(the tier's highest, floor)`` for a generation;
    ``floor`` is what the caller knows beyond this tier."""

    checkpoint_id: str
    generation: str
    floor: int = 0
    stamp: ClassVar[Stamp] = Stamp.ALWAYS


@dataclass(frozen=True)
class Renumber:
    """A save about to commit keeps the number ``claimed`` at its plan, unless a higher one was taken
    in the tier since or ``known`` (the highest commit its process knows elsewhere) reached it: then
    it claims a new one above ``known``, so that commit order is the order commits happen."""

    checkpoint_id: str
    generation: str
    claimed: int
    known: int
    stamp: ClassVar[Stamp] = Stamp.ALWAYS


@dataclass(frozen=True)
class Publish:
    """Commit ``manifest``: create-only, or replacing the id's marker (``replace``).

    ``node``: in a node-local tier only that node's files are checked. ``log=False`` when the number
    was claimed in this tier already (a save). ``expect`` (with ``replace``): the generation the
    caller judged the marker to name; if another publisher swapped it since, nothing is published."""

    manifest: Manifest
    replace: bool
    node: int | None = None
    log: bool = True
    ttl: float = 0.0
    expect: str | None = None
    stamp: ClassVar[Stamp] = Stamp.ALWAYS

    @property
    def checkpoint_id(self) -> str:
        return self.manifest.checkpoint_id


@dataclass(frozen=True)
class Drop:
    """Drop one generation; ``committed=False`` only an uncommitted one (a marker naming it, or one
    that cannot be read, keeps everything)."""

    checkpoint_id: str
    generation: str
    committed: bool = True
    ttl: float = 0.0
    stamp: ClassVar[Stamp] = Stamp.ALWAYS


@dataclass(frozen=True)
class Forget:
    """Remove a log entry whose commit does not stand (``top``: the tier's highest number)."""

    entry: LogEntry
    top: int
    stamp: ClassVar[Stamp] = Stamp.ALWAYS

    @property
    def checkpoint_id(self) -> str:
        return self.entry.checkpoint_id


@dataclass(frozen=True)
class Confirm:
    """Rewrite this node's rank part records of a generation with its commit's final number."""

    checkpoint_id: str
    generation: str
    seq: int | None
    stamp: ClassVar[Stamp] = Stamp.IF_CHANGED


@dataclass(frozen=True)
class RecordParts:
    """Part records (or a promotion's intent) written whole, then (``log``) the number the save
    claimed. ``listed``: a promoter lists these records here (a node-local tier): stamp after."""

    checkpoint_id: str
    writes: tuple[tuple[str, bytes], ...]
    log: LogEntry | None = None
    listed: bool = True

    @property
    def stamp(self) -> Stamp:
        return Stamp.ALWAYS if self.listed else Stamp.NEVER


@dataclass(frozen=True)
class Discard:
    """Remove what an actor wrote of a generation that did not commit (a failed rank's files, a
    promotion of a damaged source, a mirror received for nothing), then ``dirs`` if empty.
    ``quiet``: a failed removal is skipped (the leftovers are cleanup's). ``listed``: stamp after."""

    checkpoint_id: str
    paths: tuple[str, ...]
    dirs: tuple[str, ...] = ()
    quiet: bool = False
    listed: bool = True

    @property
    def stamp(self) -> Stamp:
        return Stamp.ALWAYS if self.listed else Stamp.NEVER


@dataclass(frozen=True)
class Sweep:
    """Cleanup's removal of one leftover that names no commit: a directory tree, an incomplete
    write, or one file (a void entry below the top, a stale record)."""

    path: str
    tree: bool = False
    write: IncompleteWrite | None = None
    stamp: ClassVar[Stamp] = Stamp.ALWAYS
    checkpoint_id: ClassVar[str] = ""


@dataclass(frozen=True)
class MirrorLand:
    """A peer mirror at rest on its holder: files checked, the owner's marker copied, the mirror
    marker last, files checked again (withdrawn over a hole)."""

    checkpoint_id: str
    owner_node: int
    commit_path: str
    commit_bytes: bytes
    marker_path: str
    marker_bytes: bytes
    files: tuple[tuple[str, FileEntry], ...]
    """``(tier-relative path, the entry it must match)`` of every received file."""
    stamp: ClassVar[Stamp] = Stamp.NEVER


@dataclass(frozen=True)
class MirrorDrop:
    """A mirror retired: its marker first; then its generation's files, unless another owner's
    mirror marker names the generation or a restore reads the id."""

    checkpoint_id: str
    generation: str
    marker_path: str
    ttl: float
    stamp: ClassVar[Stamp] = Stamp.NEVER


@dataclass(frozen=True)
class Restamp:
    """Only the change stamp: a predecessor killed between a change and its stamp left that change
    unstamped, and a promoter restamps each tier once at its start."""

    stamp: ClassVar[Stamp] = Stamp.ALWAYS
    checkpoint_id: ClassVar[str] = ""


Op = (  # every operation the executor runs
    Claim
    | Renumber
    | Publish
    | Drop
    | Forget
    | Confirm
    | RecordParts
    | Discard
    | Sweep
    | MirrorLand
    | MirrorDrop
    | Restamp
)


# ---------------------------------------------------------------------------------------------------
# Effects: what the executor performs, in order.


@dataclass(frozen=True)
class Effect:
    """One step. ``asks``: its outcome is the next event; ``changes``: it writes or deletes."""

    asks: ClassVar[bool] = False
    changes: ClassVar[bool] = True


@dataclass(frozen=True)
class Question(Effect):
    """A read: its answer is the next event."""

    asks: ClassVar[bool] = True
    changes: ClassVar[bool] = False


@dataclass(frozen=True)
class Control(Effect):
    """A step of the run itself: no tier is asked or changed."""

    changes: ClassVar[bool] = False


@dataclass(frozen=True)
class ListLog(Question):
    """The commit log above ``above`` (0: whole) -> :class:`LogListed`."""

    above: int
    purpose: str


@dataclass(frozen=True)
class PutVoid(Effect):
    """Take number ``seq``: its void entry, create-only, its body naming the claimant (a store's
    "taken" answer to a retried PUT is told from this claimant's own by the bytes) -> :class:`VoidPut`."""

    seq: int
    body: bytes
    asks: ClassVar[bool] = True


@dataclass(frozen=True)
class KeepVoid(Effect):
    """Write number ``seq``'s void entry (replacing): taken, named by nothing."""

    seq: int


@dataclass(frozen=True)
class PutEntry(Effect):
    """Name a commit in the log: ``<seq>~<id>~<generation>``."""

    seq: int
    checkpoint_id: str
    generation: str
    create_only: bool


@dataclass(frozen=True)
class RaiseHead(Effect):
    """Keep the tier's head record at least ``seq``: a hint of the log's highest number that lets
    readers list only the log's top (:mod:`tierstore.records.log`); best effort, never raises."""

    seq: int
    changes: ClassVar[bool] = False  # not in a promoter's listing: no change stamp


@dataclass(frozen=True)
class DeleteEntry(Effect):
    entry: LogEntry


@dataclass(frozen=True)
class CheckFiles(Question):
    """The manifest's files (``node``'s only, in a node-local tier) that are missing or of another
    size -> :class:`FilesChecked`."""

    manifest: Manifest
    node: int | None
    purpose: str


@dataclass(frozen=True)
class CheckSizes(Question):
    """Which of ``files`` (path, entry) are missing or not of the entry's size -> :class:`FilesChecked`."""

    files: tuple[tuple[str, FileEntry], ...]
    purpose: str


class Tolerate(enum.Enum):
    """What a marker read answers instead of raising."""

    ALL = "no marker: generation None; an unreadable one: generation ''"
    MISSING = "no marker: generation None; an unreadable one raises"
    NOTHING = "both raise"


@dataclass(frozen=True)
class ReadMarker(Question):
    """The id's marker -> :class:`MarkerRead`."""

    checkpoint_id: str
    purpose: str
    tolerate: Tolerate = Tolerate.ALL


@dataclass(frozen=True)
class PutMarker(Effect):
    """Publish the marker (atomic, durable) -> :class:`MarkerPut`, ``taken`` when a create-only one
    found a marker."""

    manifest: Manifest
    create_only: bool
    asks: ClassVar[bool] = True


@dataclass(frozen=True)
class DeleteMarker(Effect):
    checkpoint_id: str


@dataclass(frozen=True)
class DeleteParts(Effect):
    """The generation's part records (its ``parts`` directory)."""

    checkpoint_id: str
    generation: str


@dataclass(frozen=True)
class Announce(Control):
    """Hold an activity record of ``kind`` on the generation until the operation ends."""

    kind: str
    checkpoint_id: str
    generation: str
    ttl: float


@dataclass(frozen=True)
class ReadActivities(Question):
    """Whether a live activity record (younger than ``ttl``) covers the generation: any but a
    drop's, or (``drops``) only a drop's -> :class:`InUse`."""

    checkpoint_id: str
    generation: str
    ttl: float
    drops: bool = False


@dataclass(frozen=True)
class DeleteData(Effect):
    """The generation's directory, then the id's if empty (another generation may be there)."""

    checkpoint_id: str
    generation: str


@dataclass(frozen=True)
class ListParts(Question):
    """The generation's rank part records -> :class:`PartsListed`."""

    checkpoint_id: str
    generation: str


@dataclass(frozen=True)
class PutBytes(Effect):
    """Write a record whole at ``path`` (replacing)."""

    path: str
    data: bytes


@dataclass(frozen=True)
class PutRecord(Effect):
    """Publish a record at ``path`` (atomic, durable, replacing)."""

    path: str
    data: bytes


@dataclass(frozen=True)
class CheckPart(Question):
    """Whether a file the record names is missing -> :class:`PartChecked`."""

    record: PartRecord


@dataclass(frozen=True)
class DeleteFile(Effect):
    """Delete one file (absent: nothing); ``quiet``: a failure is skipped."""

    path: str
    quiet: bool = False


@dataclass(frozen=True)
class DeleteTree(Effect):
    path: str


@dataclass(frozen=True)
class DiscardIncomplete(Effect):
    write: IncompleteWrite


@dataclass(frozen=True)
class RemoveIfEmpty(Effect):
    path: str
    quiet: bool = False


@dataclass(frozen=True)
class MirrorInUse(Question):
    """Whether another owner's mirror marker names the generation, or a live ``read`` record covers
    the id -> :class:`InUse`."""

    checkpoint_id: str
    generation: str
    ttl: float


@dataclass(frozen=True)
class DropMirrorFiles(Effect):
    """The mirrored generation's files (offered for recycling first where the holder keeps spares),
    then its directory and the id's if empty."""

    checkpoint_id: str
    generation: str


@dataclass(frozen=True)
class KillPoint(Control):
    """A named moment a crash test can stop the actor at (:mod:`tierstore._platform.killpoints`)."""

    name: str


@dataclass(frozen=True)
class Done(Control):
    """The operation returns ``value``."""

    value: object = None


@dataclass(frozen=True)
class Fail(Control):
    """The operation raises ``error``."""

    error: Exception


# ---------------------------------------------------------------------------------------------------
# Events: the operation's start, and each asking effect's outcome.


@dataclass(frozen=True)
class Start:
    op: Op


@dataclass(frozen=True)
class LogListed:
    entries: tuple[LogEntry, ...]
    voids: tuple[int, ...]
    purpose: str


@dataclass(frozen=True)
class VoidPut:
    seq: int
    won: bool


@dataclass(frozen=True)
class FilesChecked:
    problems: tuple[str, ...]
    purpose: str


@dataclass(frozen=True)
class Seen:
    """A marker as read: ``generation`` None without one, '' when it cannot be read."""

    generation: str | None
    seq: int | None = None
    manifest: Manifest | None = None


NO_MARKER = Seen(None)


@dataclass(frozen=True)
class MarkerRead:
    marker: Seen
    purpose: str


@dataclass(frozen=True)
class MarkerPut:
    taken: bool


MIRROR_SHARED = "another owner's mirror of the generation remains"
MIRROR_READ = "a restore is reading it"
"""Why a retired mirror's files stay (:class:`MirrorDrop`'s result; '' when they went)."""


@dataclass(frozen=True)
class InUse:
    busy: bool
    why: str = ""


@dataclass(frozen=True)
class PartsListed:
    records: tuple[PartRecord, ...]


@dataclass(frozen=True)
class PartChecked:
    missing: bool


Event = (
    Start | LogListed | VoidPut | FilesChecked | MarkerRead | MarkerPut | InUse | PartsListed | PartChecked
)


# ---------------------------------------------------------------------------------------------------
# The view: what a running operation knows.


@dataclass(frozen=True)
class View:
    """One run's knowledge, folded from its events by :func:`observe`."""

    op: Op
    where: str = ""
    """The tier, as error messages name it."""
    seq: int = 0
    """Claim: the number taken or tried last."""
    attempts: int = 0
    """Claim: numbers tried."""
    top: int = 0
    """The tier's highest number at the last listing of the log."""
    entries: tuple[LogEntry, ...] = ()
    """The last listing's entries."""
    replaced: Seen | None = None
    """Publish with ``replace``: the marker it replaces; a retirement: the marker it retires."""
    standing: Seen | None = None
    """Publish with ``expect``: the marker standing instead of the expected one."""
    problems: tuple[str, ...] = ()
    """The last check's missing or wrong files."""
    busy: bool = False
    records: tuple[PartRecord, ...] = ()
    """Confirm: the records to rewrite (``checked`` of them done)."""
    checked: int = 0


def start(op: Op, where: str = "") -> tuple[View, Event]:
    """The view and first event of a run of ``op`` in the tier ``where`` describes."""
    return View(op=op, where=where), Start(op)


def observe(view: View, event: Event) -> View:
    """``view`` with ``event``'s outcome recorded."""
    op = view.op
    if isinstance(event, LogListed):
        floor = _listed_above(op, event.purpose)
        top = max([floor, event.entries[-1].seq if event.entries else 0, *event.voids])
        return replace(view, top=top, entries=event.entries)
    if isinstance(event, VoidPut):
        return replace(view, seq=event.seq, attempts=view.attempts + 1)
    if isinstance(event, MarkerRead) and event.purpose in ("replaced", "retire"):
        return replace(view, replaced=event.marker)
    if isinstance(event, MarkerRead) and event.purpose == "standing":
        return replace(view, standing=event.marker)
    if isinstance(event, FilesChecked):
        return replace(view, problems=event.problems)
    if isinstance(event, InUse):
        return replace(view, busy=event.busy)
    if isinstance(event, PartsListed):
        seq = op.seq if isinstance(op, Confirm) else None
        return replace(view, records=tuple(r for r in event.records if not (r.confirmed and r.seq == seq)))
    if isinstance(event, PartChecked):
        return replace(view, checked=view.checked + 1)
    return view


def _listed_above(op: Op, purpose: str) -> int:
    """The number a listing of the log started above (what the tier's highest is at least)."""
    if isinstance(op, Renumber):
        return op.claimed if purpose == "renumber" else op.known
    if purpose == "newer" and isinstance(op, Drop):
        return 0  # the listing starts above the retired commit; its own top is not a floor
    return op.floor if isinstance(op, Claim) else 0


def decide(view: View, event: Event) -> list[Effect]:
    """What to do next: ``view`` is what the operation knows, ``event`` (already observed in it) what
    just happened."""
    return _DECIDERS[type(view.op)](view, event)


# ---------------------------------------------------------------------------------------------------
# The decisions, one function per operation.


def _claim(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, Claim | Renumber)
    body = f"{op.checkpoint_id}~{op.generation}".encode()
    if isinstance(event, Start):
        return [ListLog(op.floor, "claim")] if isinstance(op, Claim) else [ListLog(op.claimed, "renumber")]
    if isinstance(event, LogListed) and event.purpose == "renumber":
        assert isinstance(op, Renumber)
        # ``known`` never holds this save's own claim: a number there equal to it is another
        # commit's (a save into another tier that took the same number meanwhile).
        if view.top > op.claimed or op.known >= op.claimed:
            return [ListLog(op.known, "claim")]
        return [Done(op.claimed)]
    if isinstance(event, LogListed):
        return [PutVoid(view.top + 1, body)]
    assert isinstance(event, VoidPut)
    if event.won:
        return [PutEntry(event.seq, op.checkpoint_id, op.generation, create_only=True), *_claimed(event.seq)]
    if view.attempts >= CLAIM_ATTEMPTS:
        return [Fail(RuntimeError(f"tier {view.where}: no free commit number after {event.seq}"))]
    return [PutVoid(event.seq + 1, body)]  # another writer took it a moment ago: the next one


def _claimed(seq: int) -> list[Effect]:
    """A number taken and logged: the head record follows it, and the claim is done."""
    return [RaiseHead(seq), Done(seq)]


def _log_first(view: View) -> bool:
    """A swap logs its number before the marker: the log still names the replaced generation, so a
    start-up read of numbers would not look at a swapped marker logged only after it. A create-only
    marker is logged after it: its loser must not forget the winner's entry, and a marker the log
    does not know is read at start-up. A marker from before the log (no number) is swapped as it
    always was: logged after."""
    op = view.op
    assert isinstance(op, Publish)
    replaced = view.replaced or NO_MARKER
    if not (op.log and op.replace and op.manifest.seq is not None and replaced.generation != ""):
        return False
    return not (
        replaced.generation and replaced.generation != op.manifest.generation and replaced.seq is None
    )


def _put_marker(op: Publish) -> list[Effect]:
    # A logging publish (a promotion) raises the head before its marker: its entry follows the
    # marker, and a cut between the two leaves the head above the log, which tells a reader that
    # a marker may be unlogged (it then lists the tier whole).
    head = [RaiseHead(op.manifest.seq)] if op.log and op.manifest.seq else []
    return [KillPoint("marker.files_checked"), *head, PutMarker(op.manifest, create_only=not op.replace)]


def _forgets(entries: tuple[LogEntry, ...], top: int, match: Callable[[LogEntry], bool]) -> list[Effect]:
    """Forget each matching entry; the tier's highest number stays taken (its void entry first), so
    the sequence never goes back and no id is named by a number it does not hold."""
    effects: list[Effect] = []
    for entry in entries:
        if match(entry):
            effects += [KeepVoid(entry.seq)] if entry.seq >= top else []
            effects.append(DeleteEntry(entry))
    return effects


def _publish(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, Publish)
    ckpt, gen = op.manifest.checkpoint_id, op.manifest.generation
    if isinstance(event, Start) and op.log:
        # A promotion may copy a generation whose earlier copy cleanup is removing: it asks for a
        # drop's record after it announced itself (before copying) and before it checks its files.
        return [ReadActivities(ckpt, gen, op.ttl, drops=True)]
    if isinstance(event, InUse) and event.why == "drops" and view.busy:
        why = f"a drop is removing generation {gen} there; promoted again at a later pass"
        return [Fail(IntegrityError(f"{ckpt}: not committed in tier {view.where}: {why}"))]
    if isinstance(event, Start) or (isinstance(event, InUse) and event.why == "drops"):
        return [CheckFiles(op.manifest, op.node, "before")]
    if isinstance(event, FilesChecked) and event.purpose == "before":
        if view.problems:
            why = f"files vanished before the marker: {'; '.join(view.problems)}"
            return [Fail(IntegrityError(f"{ckpt}: not committed in tier {view.where}: {why}"))]
        return [ReadMarker(ckpt, "replaced")] if op.replace else _put_marker(op)
    if isinstance(event, MarkerRead) and event.purpose == "replaced":
        effects: list[Effect] = []
        replaced = view.replaced or NO_MARKER
        if _log_first(view):
            if replaced.generation and replaced.generation != gen and replaced.seq is not None:
                # The standing generation keeps its own entry first: were the new number the id's
                # only entry, a swap that never happens would place the id by it.
                effects.append(PutEntry(replaced.seq, ckpt, replaced.generation, create_only=False))
                effects.append(RaiseHead(replaced.seq))
            effects.append(PutEntry(op.manifest.seq or 0, ckpt, gen, create_only=False))
        if op.expect is not None:
            return [*effects, ReadMarker(ckpt, "expect")]
        return effects + _put_marker(op)
    if isinstance(event, MarkerRead) and event.purpose == "expect":
        # Read last before the swap: a swap judged against an older marker would put an older
        # commit over a newer one committed meanwhile (the window is one marker read wide).
        if event.marker.generation == op.expect:
            return _put_marker(op)
        return [ReadMarker(ckpt, "standing", Tolerate.MISSING)]
    if isinstance(event, MarkerRead) and event.purpose == "standing":
        return [ListLog(0, "swapped")]
    if isinstance(event, LogListed) and event.purpose == "swapped":
        # Swapped since the caller judged: forget the numbers just logged (``expect``'s, whose drop
        # may have run already, and this one's unless the standing marker names it).
        standing = view.standing or NO_MARKER
        stale = {op.expect, *([gen] if standing.generation != gen else [])}
        effects = _forgets(
            view.entries, view.top, lambda e: e.checkpoint_id == ckpt and e.generation in stale
        )
        if standing.manifest is None:  # dropped meanwhile: the caller publishes create-only again
            return [*effects, Fail(FileNotFoundError(f"{ckpt}: the marker in tier {view.where} was dropped"))]
        return [*effects, Done(standing.manifest)]
    if isinstance(event, MarkerPut) and event.taken:
        return [ReadMarker(ckpt, "existing", Tolerate.NOTHING)]
    if isinstance(event, MarkerRead) and event.purpose == "existing":
        return [Done(event.marker.manifest)]
    if isinstance(event, MarkerPut):
        return [KillPoint("marker.published"), CheckFiles(op.manifest, op.node, "after")]
    if isinstance(event, FilesChecked) and event.purpose == "after":
        if view.problems:  # cleanup elsewhere removed a file while the marker went up
            return [ReadMarker(ckpt, "withdraw")]
        effects = [KillPoint("marker.rechecked")]
        if op.log and not _log_first(view) and op.manifest.seq is not None:
            effects.append(PutEntry(op.manifest.seq, ckpt, gen, create_only=False))
        return effects + _after_standing(view)
    if isinstance(event, MarkerRead) and event.purpose == "withdraw":
        why = f"files removed while it was published: {'; '.join(view.problems)}"
        error = IntegrityError(f"{ckpt}: marker withdrawn from tier {view.where}: {why}")
        return [*([DeleteMarker(ckpt)] if event.marker.generation == gen else []), Fail(error)]
    dropped = (view.replaced or NO_MARKER).generation or ""
    return _dropping(view, event, (ckpt, dropped, True, op.ttl), kept=None, gone=None)


def _after_standing(view: View) -> list[Effect]:
    """A publish whose marker stands: the generation it replaced goes (the drop's order)."""
    op = view.op
    assert isinstance(op, Publish)
    replaced = (view.replaced or NO_MARKER).generation
    if replaced and replaced != op.manifest.generation:
        return [ReadMarker(op.checkpoint_id, "drop-first")]
    return [Done(None)]


def _drop(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, Drop)
    if isinstance(event, Start):
        announce = Announce("drop", op.checkpoint_id, op.generation, op.ttl)
        return [announce, ReadMarker(op.checkpoint_id, "retire" if op.committed else "drop-first")]
    retired = view.replaced or NO_MARKER
    if isinstance(event, MarkerRead) and event.purpose == "retire":
        if retired.generation == op.generation and retired.seq is not None:
            return [ListLog(retired.seq, "newer")]
        event = replace(event, purpose="drop-first")
    elif isinstance(event, LogListed) and event.purpose == "newer":
        newer = [
            e for e in view.entries if e.checkpoint_id == op.checkpoint_id and e.generation != op.generation
        ]
        if newer:
            return [Done(False)]  # a newer commit of the id is on its way: it drops this one itself
        event = MarkerRead(retired, "drop-first")
    target = (op.checkpoint_id, op.generation, op.committed, op.ttl)
    return _dropping(view, event, target, kept=False, gone=True)


def _dropping(
    view: View, event: Event, target: tuple[str, str, bool, float], *, kept: object, gone: object
) -> list[Effect]:
    """The one order for dropping a generation (the module docstring): ``target`` is ``(id,
    generation, committed, ttl)``; ``kept`` / ``gone`` the run's result when the data stays / goes."""
    ckpt, gen, committed, ttl = target
    if isinstance(event, MarkerRead) and event.purpose == "drop-first":
        if committed:
            effects: list[Effect] = [DeleteMarker(ckpt)] if event.marker.generation == gen else []
            return [*effects, KillPoint("drop.marker_withdrawn"), ListLog(0, "drop")]
        if event.marker.generation in (gen, ""):
            return [Done(kept)]  # committed after all (or unreadable): not cleanup's to remove
        return [ListLog(0, "drop")]
    if isinstance(event, LogListed) and event.purpose == "drop":
        effects = _forgets(view.entries, view.top, lambda e: (e.checkpoint_id, e.generation) == (ckpt, gen))
        # Part records before the data: without them no promoter can start publishing it.
        return [
            *effects,
            DeleteParts(ckpt, gen),
            KillPoint("drop.records_dropped"),
            ReadActivities(ckpt, gen, ttl),
        ]
    if isinstance(event, InUse):
        return [ReadMarker(ckpt, "drop-last")]
    assert isinstance(event, MarkerRead) and event.purpose == "drop-last", event
    # Asked again: a marker naming it (a publish meanwhile) or live work on it (a restore reading
    # it, a promotion committing it) keeps the data; cleanup removes it once that is over.
    if view.busy or event.marker.generation in (gen, ""):
        return [Done(kept)]
    return [DeleteData(ckpt, gen), Done(gone)]


def _forget(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, Forget)
    return [*_forgets((op.entry,), op.top, lambda _entry: True), Done(None)]


def part_path(record: PartRecord) -> str:
    """Where a rank's part record lives (named by its first rank)."""
    return rank_part_path(record.checkpoint_id, record.generation, record.ranks[0])


def _confirm(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, Confirm)
    if isinstance(event, Start):
        return [ListParts(op.checkpoint_id, op.generation)]
    effects: list[Effect] = []
    if isinstance(event, PartChecked) and event.missing:
        # A drop ran between the listing and the rewrite (retention, a settle at the next plan):
        # the record just written would stand over missing data, and keep a part no cleanup
        # removes. Take it back.
        effects.append(DeleteFile(part_path(view.records[view.checked - 1])))
    if view.checked < len(view.records):
        record = view.records[view.checked]
        confirmed = replace(record, seq=op.seq, confirmed=True)
        return [*effects, PutBytes(part_path(record), confirmed.to_json()), CheckPart(record)]
    return [*effects, Done(bool(view.records))]


def _record_parts(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, RecordParts)
    effects: list[Effect] = [PutBytes(path, data) for path, data in op.writes]
    if op.log is not None:
        # Every node's log learns the number: whichever node coordinates next continues from it.
        effects.append(PutEntry(op.log.seq, op.log.checkpoint_id, op.log.generation, create_only=False))
        effects.append(RaiseHead(op.log.seq))
    return [*effects, Done(None)]


def _discard(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, Discard)
    effects: list[Effect] = [DeleteFile(path, quiet=op.quiet) for path in op.paths]
    return [*effects, *(RemoveIfEmpty(d, quiet=op.quiet) for d in op.dirs), Done(None)]


def _sweep(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, Sweep)
    if op.write is not None:
        return [DiscardIncomplete(op.write), Done(None)]
    return [DeleteTree(op.path) if op.tree else DeleteFile(op.path), Done(None)]


def _mirror_land(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, MirrorLand)
    if isinstance(event, Start):
        return [CheckSizes(op.files, "before its mirror marker")]
    assert isinstance(event, FilesChecked)
    if view.problems:
        lost = f"node {op.owner_node}'s mirror in tier {view.where} lost files {event.purpose}"
        error = IntegrityError(f"{op.checkpoint_id}: {lost}: {'; '.join(view.problems)}")
        withdraw: list[Effect] = [DeleteFile(op.marker_path)] if event.purpose.startswith("while") else []
        return [*withdraw, Fail(error)]
    if event.purpose.startswith("before"):
        return [
            PutRecord(op.commit_path, op.commit_bytes),
            PutRecord(op.marker_path, op.marker_bytes),
            CheckSizes(op.files, "while its mirror marker was published"),
        ]
    return [Done(None)]


def _mirror_drop(view: View, event: Event) -> list[Effect]:
    op = view.op
    assert isinstance(op, MirrorDrop)
    if isinstance(event, Start):
        return [DeleteFile(op.marker_path), MirrorInUse(op.checkpoint_id, op.generation, op.ttl)]
    assert isinstance(event, InUse)
    if view.busy:
        return [Done(event.why)]
    return [DropMirrorFiles(op.checkpoint_id, op.generation), Done("")]


_DECIDERS: dict[type, Callable[[View, Event], list[Effect]]] = {
    Claim: _claim,
    Renumber: _claim,
    Publish: _publish,
    Drop: _drop,
    Forget: _forget,
    Confirm: _confirm,
    RecordParts: _record_parts,
    Discard: _discard,
    Sweep: _sweep,
    MirrorLand: _mirror_land,
    MirrorDrop: _mirror_drop,
    Restamp: lambda _view, _event: [Done(None)],
}


class Verdict(enum.Enum):
    """What a promotion does where the target already has a marker of the id."""

    SAME = "the target holds this very generation"
    REPLACE = "the promoted copy is the newer commit of the id: it replaces the target's"
    KEEP_NEWER = "the target holds a newer commit of the id: the promoted copy is stale"
    CONFLICT = "two contents of one id that neither save knew of the other: both are kept"


def judge_promotion(
    source: Manifest, existing: Manifest, *, source_tier: str, target: str
) -> tuple[Verdict, str]:
    """Whether ``source`` (promoted from ``source_tier``) may replace ``existing`` (``target``'s
    marker of the id), and why.

    Commit order decides only between saves that knew of each other. The newer may replace the older
    when it was an overwrite (``overwrite=True``) whose job could see the older one's tier; the older
    yields to the newer on the same terms. Otherwise — a save that could not see the target (it was
    unreachable when its job started: ``unseen_tiers``), or an id saved without ``overwrite`` while
    another tier held another content of it (a race between two savers) — the two contents are in
    conflict: commit numbers taken without that knowledge say nothing, and both are kept. Markers
    from before ``overwrite`` was recorded (None) are judged by commit order, as they always were.
    """
    if existing.generation == source.generation:
        return Verdict.SAME, Verdict.SAME.value
    if target in source.unseen_tiers:
        return Verdict.CONFLICT, f"the save could not see tier {target} when its job started"
    if is_newer_commit(source.seq, source.generation, existing.seq, existing.generation):
        if source.overwrite is False:
            why = f"the id was saved without overwrite while tier {target} held another content"
            return Verdict.CONFLICT, why
        return Verdict.REPLACE, Verdict.REPLACE.value
    if existing.overwrite is False or source_tier in existing.unseen_tiers:
        why = f"tier {target}'s copy was saved without knowing of the one in {source_tier}"
        return Verdict.CONFLICT, why
    return Verdict.KEEP_NEWER, Verdict.KEEP_NEWER.value
