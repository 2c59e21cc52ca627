"""Liveness and readiness of a promoter, for ``/healthz`` and ``/readyz`` (Kubernetes probes, systemd).

"The HTTP server answers" says nothing about the promoter: the server runs in its own thread and keeps
answering while the promoter loop is wedged (a hung mount, a deadlock). So the loop reports *heartbeats*:
at every pass it starts and ends (failed passes included: an outage is not a hang, and a restart would
not cure it) and for every chunk a promotion copies. Liveness fails when no heartbeat came for
:func:`stall_bound` seconds. Readiness holds once one pass has finished.

The clock is monotonic (a wall-clock jump must not kill a healthy promoter) and injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_STALL_BOUND = 300.0
"""Seconds. Longer than one request's retries (an S3 tier's ``max_retry_time`` defaults to 120 s): a
listing that retries through a throttling episode must not look like a hang."""
STALL_INTERVALS = 10
"""A promoter sleeps ``promote.interval`` between passes; ten intervals without a heartbeat is a hang."""


def stall_bound(interval: float) -> float:
    """Seconds without a heartbeat after which a promoter polling every ``interval`` is stuck."""
    return max(STALL_INTERVALS * interval, MIN_STALL_BOUND)


@dataclass(frozen=True)
class Verdict:
    """A probe's answer: ``ok`` (HTTP 200) or not (503), and a one-line reason for people."""

    ok: bool
    reason: str


class PromoterHealth:
    """Heartbeats of one promoter loop, and what they say (thread-safe: the loop and its copy
    threads beat, the HTTP server's threads ask)."""

    def __init__(self, stall_after: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_after = stall_after
        self._clock = clock
        self._lock = threading.Lock()
        self._last_beat = clock()  # starting counts: a first pass may take a while to list tiers
        self._passes = 0
        self._failed_passes = 0
        self._last_error: str | None = None
        self._misconfigured: dict[str, str] = {}

    def beat(self) -> None:
        """The loop is making progress (a pass started, a chunk was copied)."""
        now = self._clock()
        with self._lock:
            self._last_beat = now

    def pass_finished(self) -> None:
        """A pass ran to its end: a heartbeat, and from now on the promoter is ready."""
        now = self._clock()
        with self._lock:
            self._last_beat = now
            self._passes += 1
            self._last_error = None

    def pass_failed(self, error: str) -> None:
        """A pass ended with an error (a tier could not be listed): alive, but not made ready."""
        now = self._clock()
        with self._lock:
            self._last_beat = now
            self._failed_passes += 1
            self._last_error = error.replace("\n", "; ")

    def misconfigured(self, tiers: dict[str, str]) -> None:
        """The tiers that refuse for a reason waiting will not cure, and why (none: ``{}``)."""
        with self._lock:
            self._misconfigured = dict(tiers)

    def passes(self) -> tuple[int, int]:
        """``(finished, failed)``: the passes that ran to their end, and those that failed."""
        with self._lock:
            return self._passes, self._failed_passes

    def liveness(self) -> Verdict:
        """Alive while the last heartbeat is at most ``stall_after`` seconds old."""
        with self._lock:
            idle = self._clock() - self._last_beat
        if idle > self.stall_after:
            return Verdict(False, f"stuck: no progress for {idle:.0f} s (bound {self.stall_after:.0f} s)")
        return Verdict(True, f"ok: last progress {idle:.0f} s ago")

    def readiness(self) -> Verdict:
        """Ready once a pass has finished (and still alive), and while no tier is misconfigured."""
        alive = self.liveness()
        with self._lock:
            passes, error, refused = self._passes, self._last_error, dict(self._misconfigured)
        if not alive.ok:
            return alive
        if refused:
            why = "; ".join(f"tier {name}: {reason}" for name, reason in sorted(refused.items()))
            return Verdict(False, f"not ready: a tier's configuration must be fixed: {why}")
        if passes == 0:
            why = f" (last pass failed: {error})" if error else ""
            return Verdict(False, f"not ready: no pass finished yet{why}")
        return Verdict(True, f"ready: {passes} passes finished")
