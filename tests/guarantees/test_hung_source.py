"""A promotion is watched on its target, which takes what the source gives as it comes; a *source*
that stops answering mid-copy is the source's fault: the health view (shared by every question of
the process, and passed to the node's other processes) must hold the source unreachable, not the
target, which answers fine; and a try given up on is not tried again while its copy still waits, or
every pass would leave more threads hanging. Here the source is a shared POSIX tier one of whose data
files is a FIFO with no writer: its listing and marker read answer, reading the file never does (a
hung mount's read, without FUSE). Found by review."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.simulated_job import layout, manifest_for
from tierstore._platform import health
from tierstore.config import config_from_dict
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.tiers import Tier

NAMESPACE = "blame"
PROBE_TIMEOUT = 0.5


@pytest.fixture
def fifo_holder() -> Iterator[list[str]]:
    fifos: list[str] = []
    yield fifos
    for fifo in fifos:  # a writer end lets the reader left hanging see EOF and end
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))


def hung_source(tmp_path: Path, fifo_holder: list[str]) -> tuple[Promoter, Tier, Tier]:
    """A promoter of ``mid`` -> ``durable`` whose one copy in ``mid`` has a FIFO for a data file."""
    store = f"blame-{uuid.uuid4().hex[:8]}"
    config = config_from_dict(
        {
            "namespace": NAMESPACE,
            "probe_timeout": f"{PROBE_TIMEOUT}s",
            "tiers": [
                {"name": "ram", "type": "nodedict", "store": f"{store}-ram-{{node}}"},
                {"name": "mid", "type": "shared", "path": str(tmp_path / "mid")},
                {"name": "durable", "type": "dict", "store": store},
            ],
        }
    )
    _ram, mid, durable = config.make_tiers(node=0)
    manifest = manifest_for(1, 1, NAMESPACE)
    data_path = None
    for path, data in layout(manifest):
        mid.write_bytes(path, data)
        if path != marker_path(manifest.checkpoint_id) and data_path is None and "/" in path:
            data_path = path
    assert data_path is not None
    full = os.path.join(mid.base, data_path)  # type: ignore[attr-defined]
    os.unlink(full)
    os.mkfifo(full)  # open() for reading waits for a writer that never comes
    fifo_holder.append(full)
    return Promoter(config), mid, durable


def test_a_source_that_hangs_mid_copy_is_not_taken_for_a_hung_target(
    tmp_path: Path, fifo_holder: list[str]
) -> None:
    promoter, mid, durable = hung_source(tmp_path, fifo_holder)
    try:
        promoter.run_once()
        assert not health.view().is_open(durable), "the target, which answers, is taken for hung"
        assert health.view().is_open(mid), "the source that hangs is not named"
    finally:
        promoter.context.keepers.release()


def test_a_source_that_hangs_mid_copy_does_not_accumulate_threads(
    tmp_path: Path, fifo_holder: list[str]
) -> None:
    """The hung source is never skipped (the target is blamed, and a background probe finds the
    target back at once): every later pass tries the promotion again and leaves one more copy
    hanging on the source. "A hung tier never accumulates threads" (bounded.py)."""
    promoter, _mid, _durable = hung_source(tmp_path, fifo_holder)

    def left() -> int:
        return sum(t.name.startswith(("tierstore-watch", "tierstore-copy")) for t in threading.enumerate())

    before = left()
    try:
        counts = []
        for index in range(4):
            if index:  # a probe is due (RETRY_AFTER since the breaker opened): the pass finds it back
                time.sleep(health.RETRY_AFTER + 0.1)
            promoter.run_once()
            counts.append(left() - before)
        assert counts[-1] <= counts[0], f"threads left hanging after each pass: {counts}"
    finally:
        promoter.context.keepers.release()
