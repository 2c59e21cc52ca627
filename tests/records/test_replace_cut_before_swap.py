"""A promoted overwrite killed after it logged its number and before its marker swap.

A replacing publish logs the new generation's number first (records/protocol.py). If the id's marker
in the target names a generation its log does not (a create-only promotion cut between its marker
and its log entry, a copy from before the log), the number the failed swap left is the id's only
entry there, and the catalog counted an id's only entry as its commit: after the power cut the id
was placed by the overwrite that never committed in the target, above a newer checkpoint, and
``latest_committed`` named a copy older than that one (found by an adversarial review).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tests.records.test_known_unlogged import _config, _save
from tierstore import Catalog, TieredWriter, latest_committed
from tierstore.records.log import read_log
from tierstore.records.marker import read_manifest

_PROMOTE = """
import sys
from tests.records.test_known_unlogged import _config
from tierstore.promote.sidecar import Promoter
Promoter(_config(__import__('pathlib').Path(sys.argv[1]))).run(once=True)
"""


def _promote(root: Path, kill_point: str | None) -> None:
    env = dict(os.environ)
    if kill_point is not None:
        env["TIERSTORE_KILL_POINT"] = kill_point
    proc = subprocess.run([sys.executable, "-c", _PROMOTE, str(root)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == (0 if kill_point is None else -9), proc.stderr[-2000:]


def test_an_overwrite_cut_before_its_swap_does_not_place_the_older_copy_above_a_newer_one(
    tmp_path: Path,
) -> None:
    before = tmp_path / "before"
    config = _config(before)
    _save(config, "step_1", 1.0)
    _promote(before, "marker.rechecked@step_1")  # local: step_1's marker, not its log entry
    _save(config, "step_2", 2.0)
    _promote(before, None)
    dcp.save({"w": torch.full((4,), 1.5)}, storage_writer=TieredWriter(config, overwrite=True),
             checkpoint_id="step_1")  # fmt: skip
    _promote(before, "marker.files_checked@step_1:2")  # logged, killed before the swap
    local = config.make_tiers(node=0)[1]
    kept = read_manifest(local, "step_1")
    assert kept.seq == 1, "local still holds step_1's first commit"
    assert read_manifest(local, "step_2").seq == 2
    # the power cut: host memory is empty, a new process restarts from the local tier
    after = tmp_path / "after"
    shutil.copytree(before / "local", after / "local")
    restarted = _config(after)
    logged = {(e.checkpoint_id, e.seq) for e in read_log(restarted.make_tiers(node=0)[1])}
    assert ("step_1", 3) in logged, logged  # the swap's number, logged before it was killed
    assert list(Catalog(restarted, node=0).candidates()) == ["step_2", "step_1"]
    listed = [listing.checkpoint_id for listing in Catalog(restarted, node=0).listings()]
    assert listed == ["step_2", "step_1"]  # tierstore ls
    assert latest_committed(restarted, collective=False) == "step_2"
