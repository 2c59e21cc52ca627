"""An activity record released while its heartbeat's refresh is in flight stays released.

Found by the random-kill sweep (``tests/guarantees/test_kill_points.py``, seed 11): a restarted
promoter's record, deleted when its promotion ended, was written again by the refresh that was on
its way to the tier at that moment. The zombie record looked live for another ``activity_ttl``, so
the same pass's cleanup left the dead promoter's multipart upload of that generation in the bucket.
The tier here answers a write only when the test says so: a slow S3 request, made deterministic.
"""

from __future__ import annotations

import threading
from pathlib import Path

from tierstore.records.activity import hold, live
from tierstore.tiers.posix import PosixTier


class HeldWrites(PosixTier):
    """A shared directory whose next write, once :meth:`hold_next` is called, waits for
    :attr:`go` (after setting :attr:`entered`): a write on its way to a slow tier."""

    def __init__(self, directory: Path) -> None:
        super().__init__("slow", "shared", str(directory), node_local=False)
        self.entered, self.go = threading.Event(), threading.Event()
        self.holding = False

    def hold_next(self) -> None:
        self.holding = True

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        if self.holding:
            self.holding = False
            self.entered.set()
            assert self.go.wait(30), "the test never let the write through"
        super().write_bytes(path, data)


def test_a_release_during_a_refresh_leaves_no_record(tmp_path: Path) -> None:
    tier = HeldWrites(tmp_path / "tier")
    activity = hold(tier, "promote", "step_1", "g0123456789ab", ttl=60.0)
    assert [a.path for a in live(tier, ttl=60.0)] == [activity.path]
    tier.hold_next()
    refresh = threading.Thread(target=activity.refresh)  # the heartbeat's, caught mid-write
    refresh.start()
    assert tier.entered.wait(30)
    activity.release()  # the promotion is over: its record is deleted
    tier.go.set()
    refresh.join(30)
    assert live(tier, ttl=60.0) == [], "a released record came back: cleanup would skip its data"
