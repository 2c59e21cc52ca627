"""The commit protocol, written once: every actor that commits or drops a copy calls this module.

A checkpoint exists in a tier only where its marker is. The writer (a save), the promotion job, retention,
cleanup and the peer-mirror exchange all change what is committed through these operations, each local
to one tier (it asks no other tier):

* :func:`claim` — take the next commit number in the tier's commit log, create-only.
* :func:`publish` — **the one order for publishing**: (1) every file the marker names is present at its
  size; (2) the marker is published, create-only unless it replaces (a replacing marker's commit is
  logged before it, after the replaced generation's own number); (3) the files are checked again
  (cleanup elsewhere may have removed one meanwhile) and the marker is withdrawn over a hole; (4)
  the commit is logged; (5) the generation the marker replaced is dropped.
* :func:`withdraw` — delete the marker only if it still names a given generation.
* :func:`drop` — **the one order for dropping** a generation: (1) the marker, if it names it; (2) its
  commit-log entries (never the tier's highest: the sequence's high-water mark); (3) its part records
  (without them no promoter can start publishing it); (4) asked again: a marker naming it or a live
  activity record covering it keeps the data; (5) its data, then the id's directory if empty.
* :func:`judge_promotion` — whether a promoted copy may replace the target's copy of its id (pure).
* :func:`settle_parts` — on a node other than a multi-node save's coordinator's: confirm this node's
  parts of the saves the coordinator says committed (their final number), drop those it says failed.

Ordering rules, each with a test that fails if it is broken (``tests/records``): files before marker,
marker before log entry is trusted, marker before data on drop, part records before data on drop,
every change before the tier's change stamp (:mod:`tierstore.records.changes`: each public operation
here that changes what a promoter lists stamps the tier once, after its change, also when it raises
part-way).
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from tierstore._platform.killpoints import kill_point
from tierstore.errors import IntegrityError, TierUnavailableError
from tierstore.ids import (
    commit_entry_path,
    generation_dir,
    is_newer_commit,
    marker_path,
    parts_dir,
    void_entry_path,
)
from tierstore.records.activity import ACTIVITY_TTL, activities, is_busy
from tierstore.records.changes import touch
from tierstore.records.log import LogEntry, highest_in, read_log
from tierstore.records.marker import Manifest, copy_problems, read_manifest
from tierstore.records.parts import confirm_part
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
_CLAIM_ATTEMPTS = 64
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _stamped(change: Callable[Concatenate[Tier, _P], _R]) -> Callable[Concatenate[Tier, _P], _R]:
    """``change(tier, ...)``, then the tier's change stamp, also when it raised part-way (a change
    may have happened). The operations here call each other's unstamped forms: one stamp each."""

    @functools.wraps(change)
    def stamped(tier: Tier, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return change(tier, *args, **kwargs)
        finally:
            touch(tier)

    stamped.__name__ = stamped.__qualname__ = change.__name__.lstrip("_")
    return stamped


@_stamped
def claim(tier: Tier, checkpoint_id: str, generation: str, *, floor: int = 0) -> int:
    """Take the next commit number after ``max(the tier's highest, floor)`` for this generation.

    ``floor`` is what the caller knows beyond this tier (other nodes, sightings, start-up). The
    number itself is taken first, create-only, as its void entry ``<seq>~void`` (a name that holds
    the number alone, so two writers never take one number in a tier, whatever their ids); then
    the entry ``<seq>~<id>~<generation>`` names the commit. Cleanup removes the void once a higher
    number is taken (:mod:`tierstore.promote.cleanup`). Raises ``RuntimeError`` after 64 numbers
    taken by others in a row.
    """
    seq = highest_in(tier, above=floor)  # lists only the log above what the caller knows
    for _attempt in range(_CLAIM_ATTEMPTS):
        seq += 1
        try:
            # Its body names the claimant: a store's "taken" answer to a retried create-only PUT
            # is told apart from this writer's own first attempt by the bytes (tiers/s3/tier.py).
            tier.publish(void_entry_path(seq), f"{checkpoint_id}~{generation}".encode(), create_only=True)
        except FileExistsError:
            continue  # another writer took it a moment ago: the next one
        tier.publish(commit_entry_path(seq, checkpoint_id, generation), b"", create_only=True)
        return seq
    raise RuntimeError(f"tier {tier.describe()}: no free commit number after {seq}")


def _files_problems(tier: Tier, manifest: Manifest, node: int | None) -> list[str]:
    here = [f for f in manifest.files if not tier.node_local or node is None or f.node == node]
    return copy_problems(tier, manifest, verify=False, entries=here)


@_stamped
def publish(
    tier: Tier,
    manifest: Manifest,
    *,
    replace: bool,
    node: int | None = None,
    log: bool = True,
    ttl: float = ACTIVITY_TTL,
    expect: str | None = None,
) -> Manifest | None:
    """Commit ``manifest`` in ``tier`` (the order is in the module docstring); None when published.

    ``replace=False`` publishes create-only: if the id already has a marker, nothing changes and
    that marker's manifest is returned for the caller to judge (a save refuses; a promotion may call
    again with ``replace=True``). ``replace=True`` swaps the marker atomically and drops the
    generation it named once the new one stands. ``node``: in a node-local tier, only that node's
    files are checked (the others are on their nodes). ``log=False`` when the number was claimed in
    this tier already (a save). ``expect`` (with ``replace``): the generation the caller judged
    the marker to name; if another publisher swapped it since, nothing is published and the
    marker that stands is returned, to be judged again. Raises :class:`IntegrityError` naming the
    missing files.
    """
    ckpt = manifest.checkpoint_id
    if problems := _files_problems(tier, manifest, node):
        raise IntegrityError(
            f"{ckpt}: not committed in tier {tier.describe()}: files vanished before the marker:"
            f" {'; '.join(problems)}"
        )
    replaced, replaced_seq = _marker_commit(tier, ckpt) if replace else (None, None)
    # A swap logs its number first: the log still names the replaced generation, so a start-up
    # read of numbers (records/known.py) would not look at a swapped marker logged only after it.
    # A create-only marker is logged after it: its loser must not forget the winner's entry, and a
    # marker of an id the log does not know is read at start-up.
    log_first = log and replace and manifest.seq is not None and replaced != ""
    if log_first and replaced and replaced != manifest.generation:
        if replaced_seq is None:
            log_first = False  # a marker from before the log: nothing to name it by; as before
        else:
            # The standing generation gets (keeps) its own entry first: were the new number the
            # id's only entry, a swap that never happens (killed, failed) would place the id by
            # it, for the catalog counts an id's only entry as its commit.
            _log_commit(tier, replaced_seq, ckpt, replaced)
    if log_first:
        _log_commit(tier, manifest.seq or 0, ckpt, manifest.generation)
    if replace and expect is not None and (standing := _swapped_since(tier, manifest, expect)):
        return standing
    kill_point("marker.files_checked", ckpt)
    try:
        tier.publish(marker_path(ckpt), manifest.to_json(), create_only=not replace)
    except FileExistsError:
        return read_manifest(tier, ckpt)
    except TierUnavailableError as exc:
        # The marker may stand although its PUT failed (the store did it, then answered an error).
        raise TierUnavailableError(
            f"{ckpt}: the commit's outcome in tier {tier.describe()} is unknown: {exc}; `tierstore"
            f" ls` and `tierstore verify {ckpt}` tell whether it is committed",
            tier=exc.tier,
        ) from exc
    kill_point("marker.published", ckpt)
    if problems := _files_problems(tier, manifest, node):
        _withdraw(tier, ckpt, manifest.generation)
        raise IntegrityError(
            f"{ckpt}: marker withdrawn from tier {tier.describe()}: files removed while it was"
            f" published: {'; '.join(problems)}"
        )
    kill_point("marker.rechecked", ckpt)
    if log and not log_first and manifest.seq is not None:
        _log_commit(tier, manifest.seq, ckpt, manifest.generation)
    if replaced and replaced != manifest.generation:
        _drop(tier, ckpt, replaced, ttl=ttl)
    return None


def _swapped_since(tier: Tier, manifest: Manifest, expect: str) -> Manifest | None:
    """The id's marker if it no longer names ``expect`` (another promotion swapped it since the
    caller judged it), after forgetting the numbers just logged: ``expect``'s (its drop may have
    run already) and ``manifest``'s unless the marker names that very generation; None while it
    still names ``expect``.

    Read last before the swap: a swap judged against an older marker would put an older commit
    over a newer one committed meanwhile. Not atomic with the swap (POSIX and S3 have no compare
    and swap here), the window is one marker read wide instead of the whole publish."""
    ckpt = manifest.checkpoint_id
    if _marker_generation(tier, ckpt) == expect:
        return None
    try:
        standing = read_manifest(tier, ckpt)
    except FileNotFoundError:
        standing = None
    stale = {expect}
    if standing is None or standing.generation != manifest.generation:
        stale.add(manifest.generation)
    top = highest_in(tier)
    for entry in read_log(tier):
        if entry.checkpoint_id == ckpt and entry.generation in stale:
            _forget_entry(tier, entry, top=top)
    if standing is None:  # dropped meanwhile: the caller publishes create-only again
        raise FileNotFoundError(f"{ckpt}: the marker in tier {tier.describe()} was dropped")
    return standing


def _marker_generation(tier: Tier, checkpoint_id: str) -> str | None:
    """The generation the id's marker names; None without a marker; '' when it is unreadable."""
    return _marker_commit(tier, checkpoint_id)[0]


def _marker_commit(tier: Tier, checkpoint_id: str) -> tuple[str | None, int | None]:
    """``(generation, seq)`` of the id's marker: ``(None, None)`` without a marker, ``('', None)``
    when it is unreadable."""
    try:
        manifest = read_manifest(tier, checkpoint_id)
    except FileNotFoundError:
        return None, None
    except IntegrityError:
        return "", None
    return manifest.generation, manifest.seq


def _forget_entry(tier: Tier, entry: LogEntry, *, top: int) -> None:
    """Remove a log entry whose commit does not stand. The tier's highest number (``top``) is kept as
    a void entry first: the sequence never goes back, and no id is named by a number it does not
    hold (a listing for candidates would otherwise read a marker elsewhere to place it)."""
    if entry.seq >= top:
        tier.publish(void_entry_path(entry.seq), b"", create_only=False)
    tier.delete(entry.path)


forget_entry = _stamped(_forget_entry)


def _withdraw(tier: Tier, checkpoint_id: str, generation: str) -> bool:
    """Delete the id's marker if it names ``generation``; True if it did. Not atomic with the
    check on POSIX or S3: callers withdraw only generations that nobody else publishes."""
    if _marker_generation(tier, checkpoint_id) != generation:
        return False
    tier.delete(marker_path(checkpoint_id))
    return True


withdraw = _stamped(_withdraw)


def _drop(
    tier: Tier, checkpoint_id: str, generation: str, *, committed: bool = True, ttl: float = ACTIVITY_TTL
) -> bool:
    """Drop one generation of ``checkpoint_id`` from ``tier`` (order in the module docstring).

    ``committed=False`` drops only an uncommitted generation (cleanup, a failed save): a marker
    naming it (or one that cannot be read) keeps everything, marker included. True when its data
    went; False when a marker naming it or live work on it (a restore reading it, a promotion
    committing it) kept the data, which cleanup removes once that is over. Only this generation:
    another one of the id may be an overwrite in flight.
    """
    if committed:
        _withdraw(tier, checkpoint_id, generation)
        kill_point("drop.marker_withdrawn", checkpoint_id)
    elif _marker_generation(tier, checkpoint_id) in (generation, ""):
        return False
    top = highest_in(tier)
    for entry in read_log(tier):
        if (entry.checkpoint_id, entry.generation) == (checkpoint_id, generation):
            _forget_entry(tier, entry, top=top)
    tier.delete_tree(parts_dir(checkpoint_id, generation))
    kill_point("drop.records_dropped", checkpoint_id)
    busy = is_busy([a for a in activities(tier) if a.age < ttl], checkpoint_id, generation)
    if busy or _marker_generation(tier, checkpoint_id) in (generation, ""):
        return False
    tier.delete_tree(generation_dir(checkpoint_id, generation))
    tier.remove_if_empty(checkpoint_id)  # unless another generation (an overwrite) is there
    return True


drop = _stamped(_drop)


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


def _log_commit(tier: Tier, seq: int, checkpoint_id: str, generation: str) -> None:
    """Log a commit number claimed elsewhere in ``tier``'s commit log (a node's part of a multi-node
    save: whichever node coordinates next continues from it). Its stamp also covers a rank's part
    record written just before it (:mod:`tierstore.dcp.rank_write`)."""
    tier.publish(commit_entry_path(seq, checkpoint_id, generation), b"", create_only=False)


log_commit = _stamped(_log_commit)


def settle_parts(
    tier: Tier,
    outcomes: list[tuple[str, str, int | None]],
    *,
    current: tuple[str, str, int | None] | None = None,
    ttl: float,
) -> None:
    """What a node other than the coordinator's learns at a save's plan (it never sees the marker):

    * ``outcomes``, ``(id, generation, seq)`` of the coordinator process's recent saves: its parts
      of a committed one are confirmed with the final number
      (:func:`tierstore.records.parts.confirm_part`), its parts of one that failed or that an
      overwrite replaced and dropped (``seq`` None) are dropped;
    * ``current``, ``(id, generation, seq)`` of the marker of the id being saved in the
      coordinator's tier (generation '' when there is none): its parts of that generation are
      confirmed. Nothing is dropped on its account: another generation may belong to a save still
      in flight (another job or group), or be named by a marker to come (a promotion).
    """
    held: dict[str, list[str]] = {}  # the coordinator repeats its outcomes: act on what is here
    for checkpoint_id, generation, seq in outcomes:
        if checkpoint_id not in held:
            held[checkpoint_id] = tier.list_dir(checkpoint_id)
        if generation not in held[checkpoint_id]:
            continue
        if seq is None:
            drop(tier, checkpoint_id, generation, committed=False, ttl=ttl)
        else:
            confirm_part(tier, checkpoint_id, generation, seq)
    if current is not None and current[1]:
        confirm_part(tier, *current)
