"""A promoted overwrite killed after it logged its number and before its marker swap; an overwrite
saved straight into the tier killed after claiming its number.

A replacing publish logs the new generation's number first (records/protocol.py). If the id's marker
in the target names a generation its log does not (a create-only promotion cut between its marker
and its log entry, a copy from before the log), the number the failed swap left is the id's only
entry there, and the catalog counted an id's only entry as its commit: after the power cut the id
was placed by the overwrite that never committed in the target, above a newer checkpoint, and
``latest_committed`` named a copy older than that one (found by an adversarial review). A save's
claim left the same lone entry (its number is claimed before it writes). The swap now logs the
replaced generation's number first, and the catalog places an id whose lone entry its marker does
not name by the marker's own number.
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
from tierstore.config import Config
from tierstore.records.log import read_log
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

_PROMOTE = """
import sys
from tests.records.test_known_unlogged import _config
from tierstore.promote.sidecar import Promoter
Promoter(_config(__import__('pathlib').Path(sys.argv[1]))).run(once=True)
"""
_OVERWRITE_INTO_LOCAL = """
import sys, torch, torch.distributed.checkpoint as dcp
from tests.records.test_known_unlogged import _config
from tierstore import TieredWriter
writer = TieredWriter(_config(__import__('pathlib').Path(sys.argv[1])), tier="local", overwrite=True)
dcp.save({"w": torch.full((4,), 9.0)}, storage_writer=writer, checkpoint_id="step_1")
"""


def _promote(root: Path, kill_point: str | None, script: str = _PROMOTE) -> None:
    env = dict(os.environ)
    if kill_point is not None:
        env["TIERSTORE_KILL_POINT"] = kill_point
    proc = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == (0 if kill_point is None else -9), proc.stderr[-2000:]


def _restarted_after_power_cut(before: Path, after: Path) -> Config:
    """Host memory is empty; a new process restarts from the local tier."""
    shutil.copytree(before / "local", after / "local")
    return _config(after)


def _unlogged_step_1_then_step_2(before: Path) -> Config:
    """step_1 and step_2 in memory and local; local's marker of step_1 has no log entry there (a
    create-only promotion cut between the two)."""
    config = _config(before)
    _save(config, "step_1", 1.0)
    _promote(before, "marker.rechecked@step_1")
    _save(config, "step_2", 2.0)
    _promote(before, None)
    return config


def test_an_overwrite_cut_before_its_swap_does_not_place_the_older_copy_above_a_newer_one(
    tmp_path: Path,
) -> None:
    before = tmp_path / "before"
    config = _unlogged_step_1_then_step_2(before)
    dcp.save(
        {"w": torch.full((4,), 1.5)},
        storage_writer=TieredWriter(config, overwrite=True),
        checkpoint_id="step_1",
    )
    _promote(before, "marker.files_checked@step_1:2")  # logged, killed before the swap
    local = config.make_tiers(node=0)[1]
    kept = read_manifest(local, "step_1", trust=MarkerTrust())
    assert kept.seq == 1, "local still holds step_1's first commit"
    assert read_manifest(local, "step_2", trust=MarkerTrust()).seq == 2
    restarted = _restarted_after_power_cut(before, tmp_path / "after")
    logged = {(e.checkpoint_id, e.seq) for e in read_log(restarted.make_tiers(node=0)[1])}
    assert ("step_1", 3) in logged, logged  # the swap's number, logged before it was killed
    assert list(Catalog(restarted, node=0).candidates()) == ["step_2", "step_1"]
    listed = [listing.checkpoint_id for listing in Catalog(restarted, node=0).listings()]
    assert listed == ["step_2", "step_1"]  # tierstore ls
    assert latest_committed(restarted, collective=False) == "step_2"


def test_an_overwrite_into_the_tier_killed_after_its_claim_does_not_place_the_older_copy_above(
    tmp_path: Path,
) -> None:
    before = tmp_path / "before"
    _unlogged_step_1_then_step_2(before)
    _promote(before, "writer.planned", _OVERWRITE_INTO_LOCAL)  # claimed seq 3, then killed
    restarted = _restarted_after_power_cut(before, tmp_path / "after")
    local = restarted.make_tiers(node=0)[1]
    assert [(e.checkpoint_id, e.seq) for e in read_log(local)] == [("step_2", 2), ("step_1", 3)]
    assert read_manifest(local, "step_1", trust=MarkerTrust()).seq == 1
    assert list(Catalog(restarted, node=0).candidates()) == ["step_2", "step_1"]
    assert latest_committed(restarted, collective=False) == "step_2"
