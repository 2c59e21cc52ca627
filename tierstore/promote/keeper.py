"""The keeper of each job-wide tier, as this promoter holds or watches its lease
(:mod:`tierstore.records.lease`).

Every promoter has a :class:`Keeper` per job-wide tier. Holding the lease, it renews it
``RENEWALS`` times per lease duration; watching, it reads the newest epoch's record once per
duration (one GET per node per duration: what 1,250 nodes cost the tier does not depend on the
passes they make) and takes the next epoch when :func:`~tierstore.records.lease.claim_reason`
says so. The lease duration is ``promote.keeper_lease``: a keeper that dies is replaced within three
durations (its last renewal is seen within one, it goes stale one later, and is found stale within
one more).

Fencing: a keeper acts on its tier only after :meth:`Keeper.fence` said yes, which checks that no
higher epoch exists (one request) and that its deadline has not passed: the deadline is the start
of its last successful renewal plus ``1 - MARGIN`` of the duration, and nobody takes over before a
full duration after having seen that renewal. A keeper paused (``SIGSTOP``, a long GC pause, a VM
frozen) and resumed after a takeover finds its deadline passed or the higher epoch, steps down and
acts no more. What remains: a pause between a fence that said yes and what it guards lets that land
after the takeover. A deletion, a removal and a publish are each fenced on their own (at most one of
them follows a takeover); conflict records and sightings once per pass and tier.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tierstore._platform.bounded import Prober
from tierstore.errors import IntegrityError, TierstoreError
from tierstore.records.changes import read_stamp
from tierstore.records.lease import (
    Holder,
    Lease,
    Watch,
    claim,
    claim_reason,
    holds,
    newest_epoch,
    process_alive,
    read_lease,
    renew,
    superseded,
    watched,
)
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
RENEWALS = 3
"""Renewals per lease duration: two may fail in a row before the keeper's deadline passes."""
MARGIN = 0.1
"""Of the duration, kept off the keeper's deadline: clocks of two machines may run at rates that differ."""
Report = Callable[[str, str, int, str], None]
"""Told of each change: ``(event, tier, epoch, why)`` with event ``keeper_taken`` or ``keeper_lost``."""


class Keeper:
    """This promoter's side of one job-wide tier's lease (see the module docstring). Thread-safe."""

    def __init__(
        self,
        tier: Tier,
        me: Holder,
        duration: float,
        *,
        ask: Callable[[Callable[[], Any]], Any] | None = None,
        report: Report | None = None,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int], bool] = process_alive,
        index_life: float = float("inf"),
    ) -> None:
        """``ask(question)`` asks the tier with a deadline (default: directly); ``report`` is told
        when the lease is taken or lost; ``clock`` and ``alive`` are the process's own;
        ``index_life``: see :meth:`indexed`."""
        self.tier, self.me, self.duration, self.index_life = tier, me, duration, index_life
        self._ask: Callable[[Callable[[], Any]], Any] = ask or (lambda question: question())
        self._report, self._clock, self._alive = report, clock, alive
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        """The lease held, or None."""
        self._renewed = float("-inf")
        """When the last successful renewal (or the claim) started."""
        self._epoch: int | None = None
        """The newest epoch known; None: not listed yet."""
        self._watch: Watch | None = None
        self._next_look = float("-inf")
        self._stamp: tuple[bool, bytes | None] = (False, None)
        """The tier's change stamp as the lease last read named it (``(False, None)``: unknown)."""
        self._indexed: tuple[bool, bytes | None] = (False, None)
        """Holding: the token of the index written last in this epoch (``(False, None)``: none yet,
        or the last write failed)."""
        self._indexed_at = float("-inf")
        """When (this process's clock) that index was written."""

    @property
    def epoch(self) -> int | None:
        """The epoch held, or None."""
        lease = self._lease
        return None if lease is None else lease.epoch

    def keeps(self) -> bool:
        """Whether this promoter holds the lease and its deadline has not passed (no request)."""
        return self._lease is not None and self._clock() < self._deadline()

    def stamp(self) -> tuple[bool, bytes | None]:
        """Watching: ``(True, token)``, the tier's change stamp as named by the renewal this promoter
        last read (its keeper's newest index's token, see :meth:`indexed`; no request);
        ``(False, None)`` when not known."""
        return self._stamp if self.watching() else (False, None)

    def indexed(self, token: bytes | None, *, written: bool) -> None:
        """Holding: this keeper wrote its index under ``token`` (``written``), or failed to. Its
        renewals name the newest index's token as the tier's stamp: a watcher then finds the index
        it reads current, never behind (it reads no stamp and lists nothing), and learns a change
        once the keeper indexed it. After a failed write, and once the index is ``index_life``
        old, they name the stamp read before renewing (the watchers list once a full listing is
        due, as without an index): a keeper whose passes stall (a long promotion) while this
        thread renews would otherwise hide every change since from its watchers for as long."""
        with self._lock:
            self._indexed = (written, token if written else None)
            self._indexed_at = self._clock()

    def watching(self) -> bool:
        """Whether another promoter holds the lease, as last seen (no request): a live lease of
        an epoch this one does not hold."""
        return self._lease is None and self._watch is not None

    def tick(self) -> None:
        """Renew the lease when due, or, watching, read the newest epoch's record once per duration
        and take the next epoch when its holder is gone. Tier errors are raised."""
        with self._lock:
            if self._lease is not None:
                if self._clock() - self._renewed >= self.duration / RENEWALS:
                    self._renew(self._clock())
                return
            if self._clock() < self._next_look:
                return
            # A duration apart, on the first tick after (ticks come every RENEWALS-th of one): one GET
            # per node per 30-40 s at a 30 s lease (two thirds read every 20 s: 1,250 nodes 63 GET/s,
            # not 42). A dead keeper is still replaced within three durations: its last renewal is
            # seen within a duration and a tick, and the next read, as late, finds it a duration old.
            self._next_look = self._clock() + self.duration
            self._watch_once()

    def fence(self) -> bool:
        """Whether this promoter may act on the tier now: it holds the lease, no higher epoch exists
        (asked now) and its deadline has not passed (renewed first when due). A tier error is a no."""
        with self._lock:
            if self._lease is None:
                return False
            try:
                self._renew(self._clock(), only_if_due=True)
            except (TierstoreError, OSError) as exc:
                logger.debug("cannot confirm the lease of %s: %s", self.tier.name, exc)
                return False
            return self._lease is not None and self._clock() < self._deadline()

    def release(self) -> None:
        """Give the lease up (a promoter that stops): the next epoch may be taken at once."""
        with self._lock:
            lease = self._lease
            if lease is None:
                return
            self._lease = None
            try:
                if not self._ask(lambda: superseded(self.tier, lease.epoch)):
                    self._ask(lambda: renew(self.tier, Lease(lease.epoch, lease.holder, lease.counter, True)))
            except (TierstoreError, OSError) as exc:
                logger.warning(
                    "cannot release the lease of %s (taken over when stale): %s", self.tier.name, exc
                )
            self._tell("keeper_lost", lease.epoch, "released")

    def _deadline(self) -> float:
        return self._renewed + self.duration * (1 - MARGIN)

    def _renew(self, start: float, *, only_if_due: bool = False) -> None:
        """Check no higher epoch exists (else step down), then renew if due (always unless
        ``only_if_due``). ``start``: taken before the check."""
        lease = self._lease
        assert lease is not None
        if self._ask(lambda: superseded(self.tier, lease.epoch)):
            self._lease, self._epoch, self._watch = None, lease.epoch + 1, None
            self._tell("keeper_lost", lease.epoch, f"epoch {lease.epoch + 1} was taken")
            return
        if only_if_due and start - self._renewed < self.duration / RENEWALS:
            return
        if not self._ask(lambda: holds(self.tier, lease)):  # two claims let through: one record stands
            self._lease, self._epoch, self._watch = None, lease.epoch, None
            self._tell("keeper_lost", lease.epoch, "another promoter's claim of the epoch stands")
            return
        renewed = lease.renewed(self._tier_stamp())
        self._ask(lambda: renew(self.tier, renewed))
        self._lease, self._renewed = renewed, start

    def _watch_once(self) -> None:
        """Read the newest epoch's record; take the next epoch if :func:`claim_reason` says so."""
        if self._epoch is None:
            self._epoch = self._ask(lambda: newest_epoch(self.tier))
        epoch = self._epoch
        if epoch == 0:
            self._claim(1, "no keeper yet")
            return
        lease: Lease | None
        try:
            lease = self._ask(lambda: read_lease(self.tier, epoch))
        except FileNotFoundError:  # removed behind tierstore's back: list again next time
            self._epoch = self._watch = None
            return
        except IntegrityError as exc:
            logger.warning("%s: counted as a lease that is never renewed", exc)
            lease = None
        now = self._clock()
        self._stamp = (False, None) if lease is None else lease.tier_stamp
        self._watch = watched(self._watch, epoch, None if lease is None else lease.counter, now)
        reason = claim_reason(self._watch, lease, self.me, now=now, duration=self.duration, alive=self._alive)
        if reason is not None:
            self._claim(epoch + 1, reason)

    def _tier_stamp(self) -> bytes | None:
        """What a renewal names (see :meth:`indexed`): the newest index's token while it is
        younger than ``index_life``, else the stamp now."""
        known, token = self._indexed
        fresh = known and self._clock() - self._indexed_at < self.index_life
        return token if fresh else self._ask(lambda: read_stamp(self.tier))

    def _claim(self, epoch: int, reason: str) -> None:
        start = self._clock()
        self._indexed = (False, None)  # this epoch's keeper has written no index yet
        # Named from the claim on: a lease without one sends its watchers to the stamp each pass.
        lease = Lease(epoch, self.me).stamped(self._tier_stamp())
        won = self._ask(lambda: claim(self.tier, lease))
        self._epoch, self._watch = epoch, None
        if won:
            self._lease, self._renewed = lease, start
            self._tell("keeper_taken", epoch, reason)
        else:  # another promoter took it: watch that epoch from the next look on
            self._next_look = float("-inf")

    def _tell(self, event: str, epoch: int, why: str) -> None:
        if self._report is not None:
            self._report(event, self.tier.name, epoch, why)


def _ask(prober: Prober, tier: Tier, question: Callable[[], Any]) -> Any:
    return prober.ask(tier, question, what="keep its lease")


class Keepers:
    """A :class:`Keeper` for each job-wide tier of a promoter, and the thread that renews and
    watches while the promoter loops."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        node: int,
        duration: float,
        prober: Prober,
        report: Report,
        *,
        index_life: float = float("inf"),
    ) -> None:
        """``index_life``: how long a renewal names the keeper's newest index (:meth:`Keeper.indexed`)."""
        me = Holder.here(node)
        self.duration = duration
        self.by_tier = {
            t.name: Keeper(
                t, me, duration, ask=functools.partial(_ask, prober, t), report=report, index_life=index_life
            )
            for t in tiers
            if not t.node_local
        }

    def tick(self) -> None:
        """:meth:`Keeper.tick` on every job-wide tier; a tier error is logged and skips that tier."""
        for name, keeper in self.by_tier.items():
            try:
                keeper.tick()
            except (TierstoreError, OSError) as exc:
                logger.debug("cannot keep or watch the lease of %s: %s", name, exc)

    def kept(self) -> frozenset[str]:
        """The job-wide tiers this promoter keeps now (no request)."""
        return frozenset(name for name, keeper in self.by_tier.items() if keeper.keeps())

    def watched(self) -> dict[str, bytes | None]:
        """The job-wide tiers another promoter keeps, as far as this one knows, each with its
        change stamp as named by the lease last read, where the lease names one (no request)."""
        stamps = {name: keeper.stamp() for name, keeper in self.by_tier.items()}
        return {name: token for name, (known, token) in stamps.items() if known}

    def fence(self, tier_name: str) -> bool:
        """Whether this promoter may act on ``tier_name`` now: a node-local tier always; a job-wide
        one while :meth:`Keeper.fence` says so."""
        keeper = self.by_tier.get(tier_name)
        return keeper is None or keeper.fence()

    def indexed(self, tier_name: str, token: bytes | None, *, written: bool) -> None:
        """:meth:`Keeper.indexed` of ``tier_name``'s keeper."""
        keeper = self.by_tier.get(tier_name)
        if keeper is not None:
            keeper.indexed(token, written=written)

    def release(self) -> None:
        """Give up every lease held."""
        for keeper in self.by_tier.values():
            keeper.release()

    def start(self) -> Callable[[], None]:
        """Tick in a daemon thread, ``RENEWALS`` times per duration, until the function returned is
        called (which gives up every lease held)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.duration / RENEWALS):
                self.tick()

        thread = threading.Thread(target=loop, name="tierstore-keeper", daemon=True)
        thread.start()

        def stopped() -> None:
            stop.set()
            thread.join(timeout=self.duration)
            self.release()

        return stopped
