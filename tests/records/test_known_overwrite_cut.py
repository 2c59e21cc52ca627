"""A promoted overwrite killed right after its marker swap: the log still names the id's older
generation, and the start-up read of numbers (records/known.py) reads a marker only for ids the log
does not know. Before the fix the swap was logged after the marker, and the next save took the
overwrite's number again (found by an adversarial review). A replacing marker's commit is now
logged before the swap (records/protocol.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tests.records.test_known_unlogged import _config, _save
from tierstore import TieredWriter, latest_committed
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

_PROMOTE = """
import sys
from tests.records.test_known_unlogged import _config
from tierstore.promote.sidecar import Promoter
Promoter(_config(__import__('pathlib').Path(sys.argv[1]))).run(once=True)
"""


def test_a_save_after_a_cut_between_an_overwrites_marker_and_log_entry_is_the_newest(tmp_path: Path) -> None:
    before = tmp_path / "before"
    config = _config(before)
    _save(config, "step_1", 1.0)
    assert Promoter(config).run(once=True) == 0
    dcp.save(
        {"w": torch.full((4,), 1.5)},
        storage_writer=TieredWriter(config, overwrite=True),
        checkpoint_id="step_1",
    )  # an overwrite: a new generation, a new number
    env = dict(os.environ, TIERSTORE_KILL_POINT="marker.rechecked@step_1")
    proc = subprocess.run(
        [sys.executable, "-c", _PROMOTE, str(before)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    local = config.make_tiers(node=0)[1]
    promoted = read_manifest(local, "step_1", trust=MarkerTrust())
    # the power cut: host memory is empty, a new process restarts from the local tier
    after = tmp_path / "after"
    shutil.copytree(before / "local", after / "local")
    restarted = _config(after)
    _save(restarted, "step_2", 2.0)
    fresh = read_manifest(restarted.make_tiers(node=0)[0], "step_2", trust=MarkerTrust())
    latest = latest_committed(restarted, collective=False)
    assert (fresh.seq or 0) > (promoted.seq or 0), (fresh.seq, promoted.seq)
    assert latest == "step_2"
