"""The mirror exchange: after each save, every node's memory-tier files go to its partner's memory.

Every rank's ``write_data`` hands one *round* to this process's :class:`MirrorWorker` (also when its
write failed), so every rank runs the same rounds in the same order on the job's mirror group
(:mod:`tierstore.dcp.mirror.groups`), on a background thread: the trainer's stall does not grow, and a
dead peer fails the round, never the trainer. A round:

1. all ranks share what they wrote (all-gather); if any rank failed, or ranks disagree on the save,
   the round ends for everyone (the same facts, the same decision);
2. the placement (:func:`tierstore.placement.place`) says which node holds whose files; owner rank
   ``i`` of a node sends to rank ``i mod n`` of its holder node;
3. receivers check room for their incoming files, and say so (all-gather): a holder that cannot
   take a mirror fails that owner's mirror on both sides before a byte moves;
4. the files move (point-to-point, chunked), each verified against the owner's CRC32C and renamed
   into ``.tierstore/mirror/``;
5. the coordinator waits for its commit (``finish``) and broadcasts the commit marker; it sends DCP's
   ``.metadata`` to whoever holds the coordinator's node's mirror;
6. ranks share their outcome (all-gather); the first rank of each holder node writes the copy of the
   commit marker and then the **mirror marker, last**, for each complete owner (or removes what it
   received, if the save did not commit), then drops that owner's older mirrors beyond the memory
   tier's ``keep`` (double-buffered: the previous one goes only after the new one has its marker);
   the first rank of each owner node records whether its files are mirrored.

In ``AsyncCheckpointerType.PROCESS`` mode the rounds run in DCP's checkpoint process, not in the
trainer that waits for them (``wait_mirrored``, ``close``): each handed-over save carries the path of
an *exchange-end record* (:class:`ExchangeWaits`, :mod:`tierstore.records.mirror`), which the worker
writes when the save's round has ended, however it ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tierstore._platform.owners import owner_dir_name
from tierstore._platform.runtime import ProcessLocal, SerialWorker, finalize
from tierstore.checksum import crc32c
from tierstore.dcp.mirror.groups import job_groups
from tierstore.dcp.mirror.spares import Spares
from tierstore.dcp.mirror.transport import (
    SPACE_MARGIN,
    check_room,
    chunks,
    map_file,
    post_send,
    receive_file,
    send_files,
    wait_all,
)
from tierstore.dcp.staging import STAGING_NOW
from tierstore.ids import (
    checkpoint_file,
    generation_dir,
    is_metadata_file,
    mirror_copy_path,
    mirror_id_dir,
    parts_dir,
    rank_part_path,
)
from tierstore.placement import MirrorConfig, Placement, place
from tierstore.records.activity import held, live
from tierstore.records.marker import FileEntry, Manifest
from tierstore.records.mirror import (
    MirrorMarker,
    MirrorStatus,
    exchange_end_path,
    exchange_ended,
    exchange_ends_dir,
    record_exchange_end,
    remove_exchange_waits,
    write_status,
)
from tierstore.records.mirror_retention import prune_mirrors
from tierstore.records.protocol import confirm_part, discard, land_mirror
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
_TAG_SPAN = 2**21
"""Tags one round may use between two ranks (one per 16 MiB chunk: 32 TiB from one rank to one)."""
_TAG_ROUNDS = 500
_NICE = 10
"""Priority of the exchange thread relative to the trainer's (higher is nicer)."""
_PAUSE_BUDGET_S = 30.0
"""The most one thread of a round pauses, in all, for this process's staging (and at most a
quarter of the mirror's timeout: a paused peer's messages wait that long)."""


class _YieldToStaging:
    """Called between a round's chunks: waits while this process stages (the next save's copy of
    the trainer's state, :mod:`tierstore.dcp.staging.now`), within a budget for the round. Staging
    never waits for a round, and the peer's pauses are bounded too: no pause can hang the pair."""

    def __init__(self, timeout_s: float) -> None:
        self.left = min(_PAUSE_BUDGET_S, timeout_s / 4)

    def __call__(self) -> None:
        if self.left > 0:
            self.left -= STAGING_NOW.get().wait_until_clear(self.left)


@dataclass(frozen=True)
class SavedShare:
    """What one rank wrote in a save, as every rank learns it at the start of a round."""

    checkpoint_id: str
    generation: str
    seq: int
    rank: int
    node: int
    host: str
    files: tuple[FileEntry, ...]
    wrote: bool
    coordinator: bool


class CommitOutcome:
    """Set by the coordinator's ``finish``: the published marker's bytes, or why there is none."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.marker: bytes | None = None
        self.reason = ""

    def committed(self, marker: bytes) -> None:
        """The save committed with this marker."""
        self.marker = marker
        self._event.set()

    def failed(self, reason: str) -> None:
        """The save did not commit, for certain (no marker names its generation)."""
        self.reason = reason
        self._event.set()

    def wait(self, timeout_s: float) -> Verdict:
        """The outcome; after ``timeout_s`` without one, unknown (neither committed nor failed)."""
        if not self._event.wait(timeout_s):
            return Verdict(None, f"no commit outcome within {timeout_s:.0f}s", failed=False)
        return Verdict(self.marker, self.reason, failed=self.marker is None)


@dataclass(frozen=True)
class Verdict:
    """What the coordinator tells every rank about the save after the files moved."""

    marker: bytes | None
    reason: str
    failed: bool
    """True only when the save certainly did not commit: its files may then be removed."""


@dataclass
class Round:
    """One save's mirror exchange, as seen from one rank."""

    share: SavedShare
    tier: Tier
    mirror: MirrorConfig
    keep: int | None
    activity_ttl: float = 60.0
    """How fresh a restore's ``read`` record must be for retention to leave its id alone."""
    outcome: CommitOutcome = field(default_factory=CommitOutcome)
    number: int = 0
    """This process's count of rounds so far (the same on every rank: rounds run in one order)."""
    ended_record: str | None = None
    """PROCESS mode: the exchange-end record the trainer waits for (see :class:`ExchangeWaits`)."""
    spares: Spares | None = None
    """The worker's landing files reserved ahead of time (set by :meth:`MirrorWorker.submit`)."""
    sender: SerialWorker | None = None
    """The worker's thread that sends this rank's files while this one receives (set by
    :meth:`MirrorWorker.submit`; without it, the sends run on a thread of their own)."""
    sent: list[torch.Tensor] = field(default_factory=list)
    """The mappings of the files this rank sent, let go of only after the round's end (unmapping
    256 MiB takes about 0.01 s, and interrupts every core this process runs on)."""


@dataclass(frozen=True)
class Transfer:
    """One file moving from its owner rank to a rank of the holder node."""

    sender: int
    receiver: int
    entry: FileEntry
    owner_node: int
    first_tag: int


def _ranks_by_node(shares: list[SavedShare]) -> dict[int, list[int]]:
    nodes: dict[int, list[int]] = {}
    for share in shares:
        nodes.setdefault(share.node, []).append(share.rank)
    return {node: sorted(ranks) for node, ranks in nodes.items()}


def plan_transfers(shares: list[SavedShare], placement: Placement, first_tag: int = 1) -> list[Transfer]:
    """Every file move of a round, in one order on every rank, each with its own tags.

    Tags are counted per sender and receiver (gloo matches a message by its peer and tag), so a
    round's tag span bounds what one rank sends to one other, not what the whole job moves."""
    by_node = _ranks_by_node(shares)
    by_rank = {s.rank: s for s in shares}
    transfers: list[Transfer] = []
    tags: dict[tuple[int, int], int] = {}
    for owner, holder in sorted(placement.holder_of.items()):
        receivers = by_node[holder]
        for index, rank in enumerate(by_node[owner]):
            for entry in by_rank[rank].files:
                receiver = receivers[index % len(receivers)]
                tag = tags.get((rank, receiver), first_tag)
                transfers.append(Transfer(rank, receiver, entry, owner, tag))
                tags[(rank, receiver)] = tag + max(1, chunks(entry.size))
    return transfers


class MirrorWorker:
    """Runs this process's mirror rounds in order, on one background thread of low priority (a
    :class:`~tierstore._platform.runtime.SerialWorker`), and knows when none is left."""

    def __init__(self) -> None:
        # Background work yields the CPU to the trainer: on a busy node the next save's copy and
        # the training step come first.
        self._worker = SerialWorker("tierstore-mirror", nice=_NICE)
        # Not niced: it only posts messages (gloo's own thread moves them), and under load a niced
        # thread that wakes late to post the next one would leave the wire idle.
        self._sender = SerialWorker("tierstore-mirror-send")
        self._idle = threading.Condition()
        self._busy = 0
        """Rounds queued or running (a round's end is its exchange's, before the spares refill)."""
        self._submitted = 0
        self._spares: Spares | None = None

    def submit(self, round_: Round) -> None:
        """Queue a round (called from ``write_data`` on every rank)."""
        with self._idle:
            self._busy += 1
            self._submitted += 1
            round_.number = self._submitted
            if self._spares is None:
                self._spares = Spares(round_.tier)
            round_.spares = self._spares
            round_.sender = self._sender
        self._worker.post(lambda: self._run(round_))

    @property
    def submitted(self) -> int:
        """How many rounds this process has run or queued (a forked child starts again at 0)."""
        return self._submitted

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued round has ended; False when ``timeout_s`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout_s)

    def _run(self, round_: Round) -> None:
        try:
            run_round(round_)
        except Exception:  # a mirror never fails the save or the trainer
            logger.exception("peer mirror of %s failed (reduced redundancy)", round_.share.checkpoint_id)
        finally:
            _say_ended(round_)
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
            _let_go_of_sent(round_)
        with self._idle:
            idle = self._busy == 0
        if idle and round_.spares is not None:
            # Between rounds, off every waiter's path: the next round's files land in pages
            # reserved now (a round already queued goes first and reserves its own).
            _refill(round_.spares, _YieldToStaging(round_.mirror.timeout))


def _let_go_of_sent(round_: Round) -> None:
    """Unmap the files the round sent, once this process stages no more (unmapping interrupts
    every core it runs on): after the round's end, off every waiter's path."""
    if round_.sent:
        _YieldToStaging(round_.mirror.timeout)()
        round_.sent.clear()


def _refill(spares: Spares, pause: Callable[[], None]) -> None:
    try:
        spares.refill(pause)
    except Exception as exc:  # noqa: BLE001 - without spares the next round reserves its own pages
        logger.warning("peer mirror: could not reserve landing files: %s", exc)


def _say_ended(round_: Round) -> None:
    """Write the round's exchange-end record, if a trainer in another process waits for it."""
    if round_.ended_record is None:
        return
    share = round_.share
    try:
        record_exchange_end(round_.tier, round_.ended_record, share.checkpoint_id, share.generation)
    except Exception as exc:  # noqa: BLE001 - the trainer's wait then times out, with a warning
        logger.warning("could not record the end of the mirror exchange of %s: %s", share.checkpoint_id, exc)


class ExchangeWaits:
    """The trainer's side of PROCESS mode: which handed-over saves' exchanges have not ended yet.

    Each save handed to DCP's checkpoint process gets the path of a record of its own
    (:meth:`handover`), which the worker there writes when the save's round ends. The records sit in
    a directory of this process's, outside every generation directory: an overwrite or retention
    dropping the save's generation meanwhile cannot remove them (it did remove the status records
    this used to count, and the wait never ended). The directory is locked for this process's
    lifetime (:mod:`tierstore._platform.owners`), removed by :meth:`close` or at exit, and by cleanup once
    this process is gone.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.waiter = owner_dir_name()
        self._directory = exchange_ends_dir(self.waiter)
        self._pending: list[str] = []
        self._count = 0
        # handover() runs on DCP's thread that pickles the writer, wait() on the trainer's.
        self._lock = threading.Lock()
        lock = local.own_directory(self._directory).lock if (local := tier.local) else None
        # At exit (however the trainer leaves: no close()), the directory goes with its lock.
        self._finalizer = finalize(self, _remove_waits, tier, self._directory, lock)

    def handover(self) -> str:
        """The record path for the next save handed over (it travels with the pickled writer)."""
        with self._lock:
            # Records of exchanges already over go now: a trainer that never waits keeps only
            # those of the saves in flight, not one per save it ever made.
            self._collect()
            self._count += 1
            path = exchange_end_path(self.waiter, self._count)
            self._pending.append(path)
            return path

    def wait(self, timeout_s: float | None) -> bool:
        """Until every handed-over save's exchange has ended; False when ``timeout_s`` passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self._collect():
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def close(self) -> None:
        """Remove the directory and release its lock; records arriving later are not written."""
        with self._lock:
            self._pending.clear()
            self._finalizer()

    def _collect(self) -> int:
        """Forget (and delete) the records that have arrived; how many are still awaited."""
        self._pending = [p for p in self._pending if not exchange_ended(self.tier, p)]
        return len(self._pending)


def _remove_waits(tier: Tier, directory: str, lock: int | None) -> None:
    try:
        remove_exchange_waits(tier, directory)  # the lock file with it: a late exchange writes nothing
    except Exception as exc:  # noqa: BLE001 - cleanup removes it once this process is gone
        logger.warning("could not remove %s: %s", directory, exc)
    finally:
        if lock is not None:
            os.close(lock)


class _Workers:
    """This process's mirror workers, one per memory tier root."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_root: dict[str, MirrorWorker] = {}


_WORKERS = ProcessLocal(_Workers)
"""A forked child has its own: the parent's rounds never run there, nor are waited for."""


def worker_for(tier: Tier) -> MirrorWorker:
    """This process's worker for the memory tier ``tier`` (one per tier root)."""
    workers = _WORKERS.get()
    with workers.lock:
        if tier.root not in workers.by_root:
            workers.by_root[tier.root] = MirrorWorker()
        return workers.by_root[tier.root]


def _gather(value: Any, group: dist.ProcessGroup) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


@dataclass
class _State:
    """What every step of one round needs, the same on every rank except ``round_``."""

    round_: Round
    group: dist.ProcessGroup
    shares: list[SavedShare]
    placement: Placement
    transfers: list[Transfer]
    coordinator: int
    failed: dict[int, str]
    """Owner node -> why its mirror failed (shared facts: every rank fills it identically)."""
    tag_base: int = 0
    pause: Callable[[], None] = lambda: None
    """The round thread's :class:`_YieldToStaging` (set by :func:`run_round`)."""
    not_committed: str = ""
    """Why the coordinator sent no marker (empty when it did)."""

    @property
    def me(self) -> int:
        return self.round_.share.rank

    @property
    def by_node(self) -> dict[int, list[int]]:
        return _ranks_by_node(self.shares)

    def node_of(self, rank: int) -> int:
        return next(s.node for s in self.shares if s.rank == rank)


def run_round(round_: Round) -> None:
    """Run one round on this rank (see the module docstring); every rank calls it for each save."""
    groups = job_groups(round_.mirror.timeout)
    if groups is None:
        return
    # Each step yields to this process's staging first: a round starts as its save commits, just
    # when the trainer may stage the next one (back to back).
    pause = _YieldToStaging(round_.mirror.timeout)
    pause()
    try:
        shares: list[SavedShare] = _gather(round_.share, groups.mirror)
    except Exception as exc:  # noqa: BLE001 - the group is broken (a peer died earlier)
        if round_.share.wrote:
            _record_unmirrored(round_, None, exc)
        return
    saves = {(s.checkpoint_id, s.generation) for s in shares}
    if len(saves) != 1:
        logger.error("peer mirror: ranks disagree on the save (%s); round skipped", saves)
        if round_.share.wrote:
            _record_unmirrored(round_, None, RuntimeError(f"ranks disagree on the save: {saves}"))
        return
    if not all(s.wrote for s in shares):
        _remove_failed_save(round_)  # DCP never commits a save a rank failed to write
        if round_.share.rank == min(s.rank for s in shares if s.node == round_.share.node):
            _record_unmirrored(round_, None, RuntimeError("the save failed on a rank: not committed"))
        return
    if round_.spares is not None:  # spares never take the room of this node's next own save
        node = round_.share.node
        own = sum(f.size for s in shares if s.node == node for f in s.files)
        round_.spares.keep_free = own + SPACE_MARGIN
    hosts = {s.node: s.host for s in sorted(shares, key=lambda s: s.rank)}
    placement = place(hosts, stride=round_.mirror.stride)
    if round_.share.rank == 0:
        for owner, why in placement.refused.items():
            _warn_once(f"peer mirror: node {owner} has no mirror: {why}")
    # Tags differ from round to round (rounds run in one order on every rank): a message of a round
    # that failed can never be taken for one of the next.
    base = (round_.number % _TAG_ROUNDS) * _TAG_SPAN
    state = _State(
        round_,
        groups.mirror,
        shares,
        placement,
        plan_transfers(shares, placement, base + 1),
        next(s.rank for s in shares if s.coordinator),
        dict(placement.refused),
        base,
        pause,
    )
    try:
        # Announced in this node's tier while files arrive: its cleanup takes a quiet, markerless
        # mirror directory for an exchange cut short, and must not remove one still receiving.
        with held(
            round_.tier, "write", round_.share.checkpoint_id, round_.share.generation, ttl=round_.activity_ttl
        ):
            pause()
            _prepare_incoming(state)
            pause()
            errors = _exchange(state)
            manifest = _share_commit(state, errors)
            _confirm_own_part(state, manifest)
            outcomes: list[dict[int, str]] = _gather(errors, state.group)
            _conclude(state, outcomes, manifest)
    except Exception as exc:  # noqa: BLE001 - a peer died or hung: reduced redundancy, recorded
        _record_broken_round(state, exc)


def _record_broken_round(state: _State, exc: Exception) -> None:
    """A collective of the round failed (a peer died, or hung past the timeout): this node's first
    rank records that its files have no mirror; the next save tries again."""
    node = state.round_.share.node
    if state.me == state.by_node[node][0]:
        _record_unmirrored(state.round_, state.placement.holder_of.get(node), exc)


def _record_unmirrored(round_: Round, holder: int | None, exc: Exception) -> None:
    node = round_.share.node
    reason = f"the mirror exchange failed: {type(exc).__name__}: {exc}"
    logger.warning(
        "checkpoint %s: node %d's files have no peer mirror (reduced redundancy): %s",
        round_.share.checkpoint_id,
        node,
        reason,
    )
    status = MirrorStatus(round_.share.checkpoint_id, round_.share.generation, node, holder, False, reason)
    try:
        write_status(round_.tier, status)
    except Exception as error:  # noqa: BLE001 - the log line above already says it
        logger.warning("could not record the mirror status: %s", error)


def _prepare_incoming(state: _State) -> None:
    """Check room for this rank's incoming files; owners whose holder cannot take them are marked
    failed on every rank before a byte moves."""
    round_, ckpt = state.round_, state.round_.share.checkpoint_id
    problem: str | None = None
    sizes = [t.entry.size for t in state.transfers if t.receiver == state.me]
    if round_.spares is not None:  # the last round's spares this one cannot use give their room
        round_.spares.release_unused(sizes)
    if any(len(ranks) > 1 for ranks in state.by_node.values()):
        _gather(None, state.group)  # every rank of a node released its own before any checks
    reserved = 0 if round_.spares is None else round_.spares.reserved(sizes)
    try:
        check_room(round_.tier, mirror_id_dir(ckpt), sum(sizes) - reserved)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        problem = str(exc)
    ready: list[str | None] = _gather(problem, state.group)
    for t in state.transfers:
        if ready[t.receiver] is not None:
            state.failed.setdefault(t.owner_node, f"holder rank {t.receiver}: {ready[t.receiver]}")


def _exchange(state: _State) -> dict[int, str]:
    """Move this rank's share of the files: every send is posted first, then the files to receive
    are taken one after the other. Returns what failed, per owner node."""
    round_, me = state.round_, state.me
    live = [t for t in state.transfers if t.owner_node not in state.failed]
    ckpt, timeout = round_.share.checkpoint_id, round_.mirror.timeout
    errors: dict[int, str] = {}
    sends = [  # the mappings of sent files stay alive until their messages are out
        (_readable(round_.tier, ckpt, t.entry, errors, round_.share.node, me), t.receiver, t.first_tag)
        for t in live
        if t.sender == me
    ]
    # Sends and receives each pause while this process stages, between chunks (the sends on a
    # thread of their own, so that neither waits for the other).
    sending = _on_sender(
        round_, lambda: send_files(sends, state.group, timeout_s=timeout, pause=_YieldToStaging(timeout))
    )
    pause = state.pause
    for t in live:
        if t.receiver == me:
            try:  # one file failing (a full tmpfs) must not leave the others unreceived
                receive_file(
                    round_.tier,
                    mirror_copy_path(ckpt, t.entry.path),
                    t.entry,
                    t.sender,
                    state.group,
                    first_tag=t.first_tag,
                    timeout_s=timeout,
                    spares=round_.spares,
                    pause=pause,
                )
            except Exception as exc:  # noqa: BLE001 - reported to every rank, then recorded
                errors.setdefault(t.owner_node, f"rank {me}: {t.entry.path}: {exc}")
    try:
        sending.result()
    except Exception as exc:  # noqa: BLE001 - the holder failed: this node's mirror did
        errors.setdefault(round_.share.node, f"rank {me}: sending: {exc}")
    # A failed send's exception, kept by the future, has this frame in its traceback (a cycle): the
    # sent files' mappings would stay until the next full garbage collection, not the round's end.
    del sending
    round_.sent.extend(data for data, _dst, _tag in sends)  # unmapped after the round's end
    for owner, error in errors.items():
        logger.warning("peer mirror of %s (node %d's files): %s", ckpt, owner, error)
    return errors


def _on_sender(round_: Round, job: Callable[[], None]) -> Future[Any]:
    """Run ``job`` on the round's sender thread (a worker's), else on a thread of its own."""
    if round_.sender is not None:
        return round_.sender.submit(job)
    alone = SerialWorker("tierstore-mirror-send")
    done = alone.submit(job)
    alone.close()  # its thread ends after the job
    return done


def _readable(  # noqa: PLR0917 - a helper of the two senders above and below
    tier: Tier, ckpt: str, entry: FileEntry, errors: dict[int, str], owner: int, me: int
) -> torch.Tensor:
    """The bytes of a file to send. One removed meanwhile (an overwrite replaced its generation,
    retention dropped it) is sent as zeros: the receiver still expects every chunk, fails the
    CRC32C check, and both sides go on in step (a missing message would leave the receiver waiting
    and the group broken for every later save)."""
    try:
        return map_file(tier, checkpoint_file(ckpt, entry.path), entry.size)
    except Exception as exc:  # noqa: BLE001 - recorded as this owner's failure
        errors.setdefault(owner, f"rank {me}: cannot send {entry.path}: {exc}")
        return torch.zeros(entry.size, dtype=torch.uint8)


def _share_commit(state: _State, errors: dict[int, str]) -> Manifest | None:
    """The committed marker on every rank (None if the save did not commit), and DCP's metadata
    sent to the holder of the coordinator's node (a failure is added to ``errors``)."""
    round_, me, coordinator = state.round_, state.me, state.coordinator
    found = Verdict(None, "", failed=False)
    if me == coordinator:  # within half the timeout: the others wait in the broadcast meanwhile
        found = round_.outcome.wait(round_.mirror.timeout / 2)
    box = [found]
    dist.broadcast_object_list(box, src=coordinator, group=state.group)
    verdict: Verdict = box[0]
    state.not_committed = verdict.reason
    if verdict.marker is None:
        logger.info("peer mirror of %s: not committed (%s)", round_.share.checkpoint_id, verdict.reason)
        if verdict.failed:
            _remove_failed_save(round_)
        return None
    manifest = Manifest.from_json(verdict.marker, where="the commit marker the coordinator sent")
    coordinator_node = state.node_of(coordinator)
    holder = state.placement.holder_of.get(coordinator_node)
    entry = next((f for f in manifest.files if is_metadata_file(f.path)), None)
    if holder is None or coordinator_node in state.failed or entry is None:
        return manifest
    receiver = state.by_node[holder][0]
    if me not in (coordinator, receiver):
        return manifest
    timeout, ckpt = round_.mirror.timeout, manifest.checkpoint_id
    try:
        if me == coordinator:
            data = _readable(round_.tier, ckpt, entry, errors, coordinator_node, me)
            wait_all(post_send(data, receiver, state.group, state.tag_base), timeout)
        else:
            receive_file(
                round_.tier,
                mirror_copy_path(ckpt, entry.path),
                entry,
                coordinator,
                state.group,
                first_tag=state.tag_base,
                timeout_s=timeout,
            )
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then recorded
        errors.setdefault(coordinator_node, f"rank {me}: .metadata: {exc}")
    return manifest


def _confirm_own_part(state: _State, manifest: Manifest | None) -> None:
    """Every rank now knows the committed marker: this node's first rank confirms the node's part
    records with the commit's final number (a multi-node save that committed last took a higher
    one than it planned; other nodes never see the marker itself)."""
    round_ = state.round_
    node = round_.share.node
    if manifest is None or manifest.seq is None or state.me != state.by_node[node][0]:
        return
    if node == state.node_of(state.coordinator):
        return  # the marker is here
    try:
        confirm_part(round_.tier, manifest.checkpoint_id, manifest.generation, manifest.seq)
    except Exception as exc:  # noqa: BLE001 - the promoter or the next save confirms it
        logger.warning(
            "peer mirror of %s: cannot confirm node %d's part: %s", manifest.checkpoint_id, node, exc
        )


def _conclude(state: _State, outcomes: list[dict[int, str]], manifest: Manifest | None) -> None:
    """Mirror markers on holders, status records on owners, retention: by each node's first rank."""
    round_, me, failed, by_node = state.round_, state.me, state.failed, state.by_node
    tier, ckpt, gen = round_.tier, round_.share.checkpoint_id, round_.share.generation
    coordinator_node = state.node_of(state.coordinator)
    lost: dict[int, str] = {}
    for owner, holder in sorted(state.placement.holder_of.items()):
        moved = [t for t in state.transfers if t.owner_node == owner]
        errors = [e[owner] for e in outcomes if owner in e]
        if owner not in failed and errors:
            failed[owner] = "; ".join(errors)
        if me != by_node[holder][0]:
            continue
        if manifest is None or owner in failed:
            _drop_received(tier, ckpt, gen, [t.entry for t in moved])
            continue
        blob = manifest.to_json()
        files = [t.entry for t in moved]
        if owner == coordinator_node:
            files += [f for f in manifest.files if is_metadata_file(f.path)]
        marker = MirrorMarker(
            ckpt,
            gen,
            owner,
            holder,
            tuple(by_node[owner]),
            tuple(files),
            manifest.seq,
            crc32c(blob),
            dict(manifest.topology or {}),
        )
        try:
            land_mirror(tier, blob, marker)
        except Exception as exc:  # noqa: BLE001 - a file went, or the tier failed: no mirror, said
            lost[owner] = f"{type(exc).__name__}: {exc}"  # to its owner in the collective below
            with contextlib.suppress(Exception):
                _drop_received(tier, ckpt, gen, files)
            continue
        try:
            readers = [a for a in live(tier, ttl=round_.activity_ttl) if a.kind == "read"]
            state.pause()  # freeing the dropped mirrors' pages costs CPU too
            recycle = None if round_.spares is None else round_.spares.recycle
            prune_mirrors(tier, round_.keep, readers=readers, recycle=recycle, ttl=round_.activity_ttl)
        except Exception as exc:  # noqa: BLE001 - retention retries at the promoter's next pass
            logger.warning("peer mirror of %s: retention of the mirrors failed: %s", ckpt, exc)
    # Every holder's markers are down (or withdrawn, and said so) before any owner says it is
    # mirrored.
    for said in _gather(lost, state.group):
        for owner, reason in said.items():
            failed.setdefault(owner, reason)
    mine = round_.share.node
    if me != by_node[mine][0]:
        return
    holder_node = state.placement.holder_of.get(mine)
    if manifest is None:
        failed.setdefault(mine, f"the save did not commit: {state.not_committed}")
    status = MirrorStatus(ckpt, gen, mine, holder_node, mine not in failed, failed.get(mine, ""))
    write_status(tier, status)
    if not status.mirrored and mine not in state.placement.refused:
        logger.warning(
            "checkpoint %s: node %d's files have no peer mirror (reduced redundancy): %s",
            ckpt,
            mine,
            status.reason,
        )


def _remove_failed_save(round_: Round) -> None:
    """The save certainly did not commit: this rank removes what it wrote of it (its files and part
    record), so that no node keeps evidence of a save that never happened (see ``newer_saves``)."""
    share, tier = round_.share, round_.tier
    if not share.wrote:
        return  # a rank whose write failed removed its files itself
    ckpt, gen = share.checkpoint_id, share.generation
    paths = [checkpoint_file(ckpt, entry.path) for entry in share.files]
    paths.append(rank_part_path(ckpt, gen, share.rank))
    discard(tier, ckpt, paths, dirs=(parts_dir(ckpt, gen), generation_dir(ckpt, gen)))


_warned: ProcessLocal[set[str]] = ProcessLocal(set)


def _warn_once(message: str) -> None:
    """A condition of the job's shape (one node; partners on one host): said once per process."""
    if message not in _warned.get():
        _warned.get().add(message)
        logger.warning("%s", message)


def _drop_received(tier: Tier, ckpt: str, gen: str, entries: list[FileEntry]) -> None:
    paths = [mirror_copy_path(ckpt, entry.path) for entry in entries]
    discard(tier, ckpt, paths, dirs=(f"{mirror_id_dir(ckpt)}/{gen}", mirror_id_dir(ckpt)), listed=False)
