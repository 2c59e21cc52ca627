"""Progress of long transfers: a bar on an interactive terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import threading
import time

logger = logging.getLogger(__name__)


class TransferProgress:
    """Thread-safe byte counter for one transfer; call :meth:`update` from any thread."""

    def __init__(
        self, label: str, total: int, *, interval: float = 5.0, quiet_below: int = 64 * 2**20
    ) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.started = time.monotonic()
        self._interval = interval
        self._last = 0.0
        self._lock = threading.Lock()
        self._tty = sys.stderr.isatty()
        self._quiet = total < quiet_below  # small transfers: the promotion's log line says enough

    def update(self, count: int) -> None:
        """Record ``count`` more bytes."""
        with self._lock:
            self.done += count
            if self._quiet:
                return
            now = time.monotonic()
            if now - self._last < (0.2 if self._tty else self._interval) and self.done < self.total:
                return
            self._last = now
            self._report(now)

    def _report(self, now: float) -> None:
        fraction = min(1.0, self.done / self.total)
        rate = self.done / max(now - self.started, 1e-6) / 2**20
        if self._tty:
            bar = "#" * int(fraction * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {fraction:4.0%} {rate:7.1f} MiB/s")
            if fraction >= 1.0:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            logger.info("progress %s %.0f%% (%d bytes, %.1f MiB/s)", self.label, fraction * 100,
                        self.done, rate)  # fmt: skip
