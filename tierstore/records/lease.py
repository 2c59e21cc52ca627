"""The keeper lease of a job-wide tier: which one promoter of the job lists, promotes out of,
retains and cleans a shared or S3 tier.

One record per *epoch*, ``.tierstore/keeper/lease-<epoch>.json``, taken create-only in order, renewed
by its holder only; taking, renewing, taking over and fencing are docs/design.md, "One keeper per
job-wide tier". When to take over is decided by :func:`claim_reason`, on the watcher's own monotonic
clock only: a watcher's timer starts after the holder's last renewal started, so by the time anyone
may take over, the holder's deadline (:mod:`tierstore.promote.keeper`) has passed.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from tierstore.errors import IntegrityError
from tierstore.ids import KEEPER_DIR, lease_path, parse_lease_path
from tierstore.records.marker import dump_record, load_record
from tierstore.tiers import Tier
from tierstore.topology import current_host

FORMAT = "tierstore.lease/1"


def _pid_namespace() -> str:
    """This process's pid namespace: two containers on one host share a boot id, not their pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


@dataclass(frozen=True)
class Holder:
    """Who holds (or wants) a lease: one promoter process, and one keeper object in it."""

    node: int
    host: str
    pidns: str
    pid: int
    token: str
    """Random, per keeper object: tells two keepers of one process apart."""
    started: float
    """When the holder took its lease (wall clock; for people only, never compared)."""

    @classmethod
    def here(cls, node: int) -> Holder:
        """This process, as a new holder."""
        return cls(node, current_host(), _pid_namespace(), os.getpid(), secrets.token_hex(8), time.time())

    def describe(self) -> str:
        """``node N (host, pid P)``, for logs."""
        return f"node {self.node} ({self.host}, pid {self.pid})"


@dataclass(frozen=True)
class Lease:
    """One epoch's lease record."""

    epoch: int
    holder: Holder
    counter: int = 0
    """Raised by every renewal."""
    released: bool = False
    """Given up by its holder (a promoter that stopped): anyone may take the next epoch at once."""
    stamp: str | None = None
    """The tier's change stamp as of this renewal or claim (hex; ``""``: the tier had none; None:
    not recorded, a holder of an older release): the token of the newest index its holder wrote
    (:mod:`tierstore.records.index`), else the stamp it read before writing this record. A watcher's
    one read of the lease also tells it whether the tier changed (:mod:`tierstore.records.changes`),
    so it reads no stamp, and the index it then reads is never behind the token named here."""

    def stamped(self, stamp: bytes | None) -> Lease:
        """This record naming the tier's change stamp ``stamp``."""
        return replace(self, stamp=(stamp or b"").hex())

    def renewed(self, stamp: bytes | None) -> Lease:
        """The record of the next renewal, naming ``stamp``."""
        return replace(self.stamped(stamp), counter=self.counter + 1)

    @property
    def tier_stamp(self) -> tuple[bool, bytes | None]:
        """``(recorded, the tier's change token)`` as :func:`~tierstore.records.changes.read_stamp`
        gives it: None for a tier without a stamp."""
        if self.stamp is None:
            return False, None
        return True, bytes.fromhex(self.stamp) or None

    def to_json(self) -> bytes:
        """Serialize."""
        return dump_record(FORMAT, asdict(self), ())

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Lease:
        """Parse; :class:`IntegrityError` naming ``where`` if malformed."""
        try:
            body = load_record(FORMAT, data)
            h = body["holder"]
            holder = Holder(
                int(h["node"]),
                str(h["host"]),
                str(h["pidns"]),
                int(h["pid"]),
                str(h["token"]),
                float(h["started"]),
            )
            stamp = body.get("stamp")
            return cls(
                int(body["epoch"]),
                holder,
                int(body["counter"]),
                bool(body["released"]),
                None if stamp is None else str(stamp),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where}: malformed lease record ({exc})") from None


@dataclass(frozen=True)
class Watch:
    """What a watcher last read of the newest epoch it knows, and since when (its monotonic clock)."""

    epoch: int
    counter: int | None
    """None: the record could not be parsed (it never changes: taken over after ``duration``)."""
    since: float


def watched(prior: Watch | None, epoch: int, counter: int | None, now: float) -> Watch:
    """The watch after reading ``counter`` of ``epoch`` at ``now``: its timer restarts when the
    epoch or the counter changed (the holder renewed), else it keeps running."""
    if prior is not None and prior.epoch == epoch and prior.counter == counter:
        return prior
    return Watch(epoch, counter, now)


def claim_reason(
    watch: Watch,
    lease: Lease | None,
    me: Holder,
    *,
    now: float,
    duration: float,
    alive: Callable[[int], bool],
) -> str | None:
    """Why ``me`` may take the epoch after ``watch.epoch`` now, or None (pure). ``lease``: the record
    just read (None: unreadable). ``alive(pid)`` tells whether a process of this host is running."""
    if lease is not None:
        if lease.released:
            return "released"
        theirs = lease.holder
        if theirs.token == me.token:
            return None  # my own: never taken from myself
        if (theirs.host, theirs.pidns) == (me.host, me.pidns) and (
            theirs.pid == me.pid or not alive(theirs.pid)
        ):
            return "its holder's process is gone"  # a restart on this host, or an earlier keeper here
    if now - watch.since >= duration:
        return f"not renewed for {now - watch.since:.1f} s"
    return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def newest_epoch(tier: Tier) -> int:
    """The highest epoch with a lease record in ``tier`` (0: none yet). One listing."""
    epochs = [parse_lease_path(info.path) for info in tier.find(KEEPER_DIR)]
    return max([e for e in epochs if e is not None], default=0)


def read_lease(tier: Tier, epoch: int) -> Lease:
    """The lease record of ``epoch``; ``FileNotFoundError`` if there is none,
    :class:`IntegrityError` if it is damaged."""
    path = lease_path(epoch)
    return Lease.from_json(tier.read_bytes(path), where=f"tier {tier.name}: {path}")


def superseded(tier: Tier, epoch: int) -> bool:
    """Whether a higher epoch than ``epoch`` was taken (one request: epochs are taken in order)."""
    return tier.exists(lease_path(epoch + 1))


def claim(tier: Tier, lease: Lease) -> bool:
    """Take ``lease.epoch``: create its record (create-only), then read it back; True if the record
    names ``lease.holder`` (this call won)."""
    try:
        tier.publish(lease_path(lease.epoch), lease.to_json(), create_only=True)
    except FileExistsError:
        return False
    return holds(tier, lease)


def holds(tier: Tier, lease: Lease) -> bool:
    """Whether ``lease.epoch``'s record still names ``lease.holder``: a store whose create-only
    publish is not atomic (moto) can let two claims of one epoch through; the record left names one."""
    return read_lease(tier, lease.epoch).holder.token == lease.holder.token


def renew(tier: Tier, lease: Lease) -> None:
    """Rewrite the holder's record (a renewal, or with ``released`` the release). Only its holder
    calls it, after checking that no higher epoch exists."""
    tier.publish(lease_path(lease.epoch), lease.to_json(), create_only=False)
