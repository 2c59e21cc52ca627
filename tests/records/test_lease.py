"""The keeper lease: when a watcher may take over (table), the records in a real tier, and one
keeper at a time as seen by :class:`~tierstore.promote.keeper.Keeper` on a clock the test moves."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tierstore.config import config_from_dict
from tierstore.ids import lease_path, parse_lease_path
from tierstore.promote.keeper import RENEWALS, Keeper
from tierstore.records.lease import (
    Holder,
    Lease,
    Watch,
    claim,
    claim_reason,
    newest_epoch,
    read_lease,
    renew,
    superseded,
    watched,
)
from tierstore.tiers import Tier, make_tier

ME = Holder(1, "host-b", "pid:[1]", 200, "me", 0.0)
OTHER_HOST = Holder(0, "host-a", "pid:[1]", 100, "them", 0.0)
SAME_HOST = dataclasses.replace(OTHER_HOST, host="host-b")
SAME_PROCESS = dataclasses.replace(SAME_HOST, pid=200)
DURATION = 30.0

CLAIMS = [
    ("renewed just now", Lease(3, OTHER_HOST, 7), Watch(3, 7, 100.0), 100.0, None),
    ("not renewed for less than a duration", Lease(3, OTHER_HOST, 7), Watch(3, 7, 100.0), 129.9, None),
    ("not renewed for a duration", Lease(3, OTHER_HOST, 7), Watch(3, 7, 100.0), 130.0, "not renewed"),
    ("released", Lease(3, OTHER_HOST, 7, released=True), Watch(3, 7, 100.0), 100.0, "released"),
    ("an unreadable record, fresh", None, Watch(3, None, 100.0), 100.0, None),
    ("an unreadable record, a duration old", None, Watch(3, None, 100.0), 130.0, "not renewed"),
    ("a process of this host that is gone", Lease(3, SAME_HOST, 7), Watch(3, 7, 100.0), 100.0, "gone"),
    ("an earlier keeper of this very process", Lease(3, SAME_PROCESS, 7), Watch(3, 7, 100.0), 100.0, "gone"),
    ("my own record, however old", Lease(3, ME, 7), Watch(3, 7, 100.0), 1000.0, None),
]


@pytest.mark.parametrize(("case", "lease", "watch", "now", "expected"), CLAIMS, ids=[c[0] for c in CLAIMS])
def test_when_a_watcher_may_take_over(
    case: str, lease: Lease | None, watch: Watch, now: float, expected: str | None
) -> None:
    reason = claim_reason(watch, lease, ME, now=now, duration=DURATION, alive=lambda pid: pid != 100)
    assert (reason is None) == (expected is None), case
    assert expected is None or (reason is not None and expected in reason), (case, reason)


def test_a_live_process_of_this_host_is_waited_for() -> None:
    reason = claim_reason(Watch(3, 7, 100.0), Lease(3, SAME_HOST, 7), ME, now=100.0, duration=30, alive=bool)
    assert reason is None


def test_the_timer_restarts_only_when_the_counter_or_the_epoch_changes() -> None:
    first = watched(None, 3, 7, 100.0)
    assert watched(first, 3, 7, 150.0) is first, "unchanged: the timer keeps running"
    assert watched(first, 3, 8, 150.0) == Watch(3, 8, 150.0), "renewed"
    assert watched(first, 4, 7, 150.0) == Watch(4, 7, 150.0), "another epoch"


def test_lease_paths_round_trip() -> None:
    assert parse_lease_path(lease_path(12)) == 12
    assert parse_lease_path(".tierstore/keeper/lease-x.json") is None
    assert parse_lease_path(".tierstore/keeper/other.json") is None


@pytest.fixture
def shared(tmp_path: Path) -> Tier:
    config = config_from_dict({"tiers": [{"name": "pfs", "type": "shared", "path": str(tmp_path / "pfs")}]})
    return make_tier(config.tiers[0], namespace=None, node=0)


def test_one_claim_of_an_epoch_wins(shared: Tier) -> None:
    assert newest_epoch(shared) == 0
    assert claim(shared, Lease(1, OTHER_HOST))
    assert not claim(shared, Lease(1, ME)), "create-only: the second loses"
    assert read_lease(shared, 1).holder == OTHER_HOST
    assert newest_epoch(shared) == 1 and not superseded(shared, 1)
    assert claim(shared, Lease(2, ME))
    assert newest_epoch(shared) == 2 and superseded(shared, 1)


class Clock:
    """A monotonic clock the test moves (one per simulated machine: they are never compared)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keeper(tier: Tier, node: int, clock: Clock) -> Keeper:
    return Keeper(
        tier, Holder(node, f"host-{node}", "ns", 100 + node, f"t{node}", 0.0), DURATION, clock=clock
    )


def test_the_first_promoter_keeps_the_others_watch(shared: Tier) -> None:
    clock = Clock()
    a, b = keeper(shared, 0, clock), keeper(shared, 1, clock)
    a.tick()
    b.tick()
    assert (a.epoch, a.keeps(), b.epoch, b.keeps()) == (1, True, None, False)
    assert a.fence() and not b.fence()


def test_a_keeper_that_renews_is_never_taken_over(shared: Tier) -> None:
    clock = Clock()
    a, b = keeper(shared, 0, clock), keeper(shared, 1, clock)
    a.tick()
    for _ in range(20):  # ten durations, renewed on time
        clock.now += DURATION / RENEWALS
        a.tick()
        b.tick()
    assert a.keeps() and a.epoch == 1 and b.epoch is None


def test_a_watcher_reads_the_lease_once_per_duration_however_often_it_ticks(shared: Tier) -> None:
    """What 1,250 watchers ask of a job-wide tier: one read of the lease a duration (GET/s = nodes /
    duration), whether ticked by its thread alone (every RENEWALS-th of a duration) or by passes too."""
    clock = Clock()
    a = keeper(shared, 0, clock)
    reads: list[float] = []

    def ask(question: Callable[[], Any]) -> Any:
        reads.append(clock.now)
        return question()

    me = Holder(1, "host-1", "ns", 101, "t1", 0.0)
    b = Keeper(shared, me, DURATION, clock=clock, ask=ask)
    a.tick()
    b.tick()  # lists the epochs, reads the lease
    reads.clear()
    for step in (DURATION / RENEWALS, DURATION / RENEWALS / 4):
        reads.clear()
        started = clock.now
        while clock.now < started + 10 * DURATION:
            clock.now += step
            a.tick()
            b.tick()
        gaps = [later - earlier for earlier, later in itertools.pairwise(reads)]
        assert len(reads) == 10, (step, reads)
        assert all(DURATION <= gap < DURATION + step + 1e-9 for gap in gaps), (step, gaps)
    assert a.keeps() and b.epoch is None, "renewed on time: never taken over"


def test_a_keeper_that_stops_renewing_is_taken_over_and_fenced_after_a_pause(shared: Tier) -> None:
    """The keeper is paused (its clock runs, it does nothing); the watcher takes epoch 2 once the
    counter stood still for a duration of its own clock; resumed, the old keeper's fence says no
    (its deadline passed and a higher epoch exists), and it steps down."""
    clock = Clock()
    a, b = keeper(shared, 0, clock), keeper(shared, 1, clock)
    a.tick()
    b.tick()  # first sight of counter 0, at once
    seen_at, deadline_passed = clock.now, None
    while b.epoch is None:  # b's thread ticks RENEWALS times per duration; a is paused
        clock.now += DURATION / RENEWALS / 4
        b.tick()
        if deadline_passed is None and not a.keeps():
            deadline_passed = clock.now
    assert deadline_passed is not None and deadline_passed < clock.now, "a stops acting first"
    assert seen_at + DURATION <= clock.now <= seen_at + 2 * DURATION, "a whole duration, then one read"
    assert b.epoch == 2 and b.keeps()
    assert not a.fence(), "resumed after the takeover: no action"
    assert a.epoch is None and not a.keeps()
    a.tick()  # now a watcher of epoch 2
    assert a.epoch is None and b.fence()


def test_a_resumed_keeper_within_its_deadline_sees_the_higher_epoch(shared: Tier) -> None:
    """Even were its deadline not passed (clocks running at different rates), the fence asks the
    tier whether a higher epoch exists."""
    clock_a, clock_b = Clock(), Clock()
    a, b = keeper(shared, 0, clock_a), keeper(shared, 1, clock_b)
    a.tick()
    b.tick()
    clock_b.now += DURATION  # b's clock ran fast
    b.tick()
    assert b.epoch == 2
    assert a.keeps(), "a's own clock says its deadline holds"
    assert not a.fence()


def test_a_released_lease_is_taken_at_once(shared: Tier) -> None:
    clock = Clock()
    a, b = keeper(shared, 0, clock), keeper(shared, 1, clock)
    a.tick()
    b.tick()
    a.release()
    assert not a.keeps() and read_lease(shared, 1).released
    clock.now += DURATION  # b reads once per duration at most
    b.tick()
    assert b.epoch == 2


def test_two_watchers_of_a_dead_keeper_one_takes_over(shared: Tier) -> None:
    clock = Clock()
    a, b, c = keeper(shared, 0, clock), keeper(shared, 1, clock), keeper(shared, 2, clock)
    a.tick()
    b.tick()
    c.tick()
    clock.now += DURATION
    b.tick()
    c.tick()
    assert (b.epoch, c.epoch) == (2, None), "c lost the create-only claim of epoch 2"
    clock.now += DURATION
    b.tick()
    c.tick()
    assert b.keeps() and not c.keeps(), "c watches epoch 2, renewed by b"


def test_of_two_claims_let_through_the_one_whose_record_stands_keeps(shared: Tier) -> None:
    """moto checks a create-only PUT and writes without a lock: two claims of one epoch can both
    succeed. The record left names one holder; the other steps down at its next renewal."""
    clock = Clock()
    a, b = keeper(shared, 0, clock), keeper(shared, 1, clock)
    a.tick()
    renew(shared, Lease(1, b.me))  # b's claim, let through after a's, overwrote a's record
    clock.now += DURATION / RENEWALS
    a.tick()
    assert not a.keeps() and a.epoch is None


def test_the_lease_names_the_stamp_from_the_claim_then_the_newest_index_token(shared: Tier) -> None:
    """A claim names the tier's stamp (its watchers read none themselves); once the keeper wrote an
    index, each renewal names that index's token though the tier changed since, so a watcher never
    finds the index behind the lease; after a failed index write, the stamp read before renewing."""
    from tierstore.records.changes import read_stamp, touch

    clock = Clock()
    a, b = keeper(shared, 0, clock), keeper(shared, 1, clock)
    touch(shared)
    a.tick()
    b.tick()
    assert b.stamp() == (True, read_stamp(shared)), "named by the claim"
    indexed = read_stamp(shared)
    a.indexed(indexed, written=True)
    touch(shared)  # a change the keeper has not indexed yet
    clock.now += DURATION / RENEWALS
    a.tick()
    clock.now += DURATION
    b.tick()
    assert read_stamp(shared) != indexed
    assert b.stamp() == (True, indexed), "the index's token, not the stamp now"
    a.indexed(None, written=False)
    clock.now += DURATION / RENEWALS
    a.tick()
    clock.now += DURATION
    b.tick()
    assert b.stamp() == (True, read_stamp(shared)), "after a failed write: the stamp now"


def test_the_lease_names_the_stamp_once_the_keepers_index_is_older_than_its_life(shared: Tier) -> None:
    """A keeper whose passes stall (its thread renews, it lists and indexes no more): its renewals
    name its index's token only while the index is younger than ``index_life``, then the stamp read
    before renewing, so that its watchers see the change since (and list once a full listing is
    due); a new index names its token again."""
    from tierstore.records.changes import read_stamp, touch

    clock, life = Clock(), 2 * DURATION
    a = Keeper(shared, Holder(0, "host-0", "ns", 100, "t0", 0.0), DURATION, clock=clock, index_life=life)
    b = keeper(shared, 1, clock)
    touch(shared)
    a.tick()
    b.tick()
    indexed = read_stamp(shared)
    a.indexed(indexed, written=True)
    touch(shared)  # a change the stalled keeper never indexes
    named = []
    while clock.now < 1000.0 + 2 * life:
        clock.now += DURATION / RENEWALS
        a.tick()
        named.append((clock.now - 1000.0, read_lease(shared, 1).tier_stamp))
    young = [stamp for at, stamp in named if at < life]
    old = [stamp for at, stamp in named if at > life + DURATION / RENEWALS]
    assert young and set(young) == {(True, indexed)}, "its index's token while the index is young"
    assert old and set(old) == {(True, read_stamp(shared))}, "then the stamp now"
    newer = read_stamp(shared)
    a.indexed(newer, written=True)
    touch(shared)
    clock.now += DURATION / RENEWALS
    a.tick()
    assert read_lease(shared, 1).tier_stamp == (True, newer), "a new index: its token again"
