"""Progress of long byte transfers (restores, verifications, promotions) for people at a terminal.

A bar (``tqdm``) on an interactive terminal only: in a log file, a pipe or a container's log stream it
writes nothing, so logs keep their one line per finished operation. A bar appears only once its
operation has run for ``delay`` seconds: quick operations never flash one.

Thread-safe: a transfer's chunks arrive from several copy threads.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

DELAY = 1.0
"""Seconds an operation runs before its bar appears."""


class ByteProgress:
    """A byte counter for one operation, shown as a bar on an interactive terminal."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        delay: float | None = None,
    ) -> None:
        """``label`` names the operation (``restore step_200 from s3``); ``total`` is its bytes;
        ``stream`` defaults to standard error. The bar shows only when ``enabled`` and the stream
        is a terminal; otherwise this only counts. ``delay`` defaults to :data:`DELAY`."""
        out = sys.stderr if stream is None else stream
        self.done = 0
        self._lock = threading.Lock()
        self._bar = tqdm(
            total=max(total, 0),
            desc=label,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=out,
            disable=not (enabled and _is_terminal(out)),
            leave=False,
            delay=DELAY if delay is None else delay,
            dynamic_ncols=True,
            mininterval=0.2,
        )

    @property
    def shown(self) -> bool:
        """True when the bar can appear (the stream is a terminal)."""
        return not self._bar.disable

    def update(self, count: int) -> None:
        """Record ``count`` more bytes (from any thread)."""
        with self._lock:
            self.done += count
            self._bar.update(count)

    def close(self) -> None:
        """Remove the bar (the operation's own summary line follows)."""
        with self._lock:
            self._bar.close()

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream is no terminal
        return False
