"""What a benchmark phase needs of the run: a protocol that :class:`benchmarks.bench.Bench` meets.

Phases (``stalls.py``, ``mirror.py``) are called by ``bench.py`` and type their argument with this
protocol instead of importing ``bench.py``, so that no module imports the one that imports it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Protocol

from tierstore.config import Config


class Bench(Protocol):
    """One ``make bench`` run: where it writes, its S3 endpoint, and its figures."""

    args: argparse.Namespace
    shm: Path
    disk: Path
    endpoint: str
    bucket: str
    s3: Any
    results: dict[str, Any]
    extra: dict[str, Any]

    def config(self, *kinds: str, namespace: str) -> Config:
        """A configuration of the tiers named, under ``namespace``."""

    def sample(self, name: str, seconds: float, nbytes: int) -> None:
        """Add one timing to a figure."""

    def pair(self, name: str, ratio: float) -> None:
        """Add one ratio measured within a round."""

    def show(self, *names: str) -> None:
        """Print the figures named."""
