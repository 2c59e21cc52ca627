"""Files that hang their reader, as a file on a hung mount does, and tiers nobody answers for."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def fifo_at(path: Path) -> Iterator[None]:
    """``path`` becomes a FIFO: opening it to read blocks. Released at the end (a writer opens and
    closes it), so no reading thread stays blocked after the test."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def refusing_s3_tier(name: str = "s3") -> dict[str, Any]:
    """An s3 tier's YAML entry whose endpoint is a loopback port nobody listens on: every request
    is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    return {
        "name": name,
        "type": "s3",
        "url": "s3://away/ckpt",
        "max_attempts": 2,
        "endpoint_url": f"http://127.0.0.1:{closed}",
    }
