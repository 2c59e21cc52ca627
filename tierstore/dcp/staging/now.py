"""Whether this process is staging now: the signal background work of earlier saves yields to.

The trainer's stall is the staging copy (DESIGN.md "Staging and speed"). On a node with few cores,
an earlier save's background transfer (the peer mirror's exchange) competes with that copy for
the CPU and lengthens the stall. So the stager holds :data:`STAGING_NOW` while it copies, and
background work asks :meth:`StagingNow.wait_until_clear` between its pieces: it pauses, for a
bounded time, until no copy of this process runs. Nothing here ever waits for background work,
so a pause cannot close a cycle.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from tierstore._platform.runtime import ProcessLocal


class StagingNow:
    """How many staging copies of this process run now (any thread, any tier)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._copies = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Say "a staging copy runs" for the duration of the block (blocks may nest or overlap)."""
        with self._changed:
            self._copies += 1
        try:
            yield
        finally:
            with self._changed:
                self._copies -= 1
                self._changed.notify_all()

    @property
    def active(self) -> bool:
        """True while some staging copy of this process runs."""
        return self._copies > 0

    def wait_until_clear(self, timeout_s: float) -> float:
        """Wait until no staging copy runs, at most ``timeout_s``; returns the seconds waited."""
        if not self._copies:
            return 0.0
        started = time.monotonic()
        with self._changed:
            self._changed.wait_for(lambda: not self._copies, max(0.0, timeout_s))
        return time.monotonic() - started


STAGING_NOW = ProcessLocal(StagingNow)
"""This process's signal (a forked child, e.g. DCP's checkpoint process, has its own)."""
