"""Review: a promotion is watched on its *target* (``promote.run``: ``ctx.bounded(target, copy)``), so
a *source* that stops answering mid-copy is taken for a hung target: the health view (shared by
every question of the process, and passed to the node's other processes) skips the target, which
answers fine, and the source that hangs is not named. Here the source is a shared POSIX tier one of
whose data files is a FIFO with no writer: its listing and marker read answer, reading the file
never does (a hung mount's read, without FUSE)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.simulated_job import layout, manifest_for
from tierstore._platform import health
from tierstore.config import config_from_dict
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter

NAMESPACE = "blame"
PROBE_TIMEOUT = 0.5


@pytest.fixture
def fifo_holder() -> Iterator[list[str]]:
    fifos: list[str] = []
    yield fifos
    for fifo in fifos:  # a writer end lets the reader left hanging see EOF and end
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))


def test_a_source_that_hangs_mid_copy_is_not_taken_for_a_hung_target(
    tmp_path: Path, fifo_holder: list[str]
) -> None:
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
    full = os.path.join(mid.base, data_path)
    os.unlink(full)
    os.mkfifo(full)  # open() for reading waits for a writer that never comes
    fifo_holder.append(full)
    promoter = Promoter(config)
    try:
        promoter.run_once()
        assert not health.view().is_open(durable), "the target, which answers, is taken for hung"
        assert health.view().is_open(mid), "the source that hangs is not named"
    finally:
        promoter.context.keepers.release()
