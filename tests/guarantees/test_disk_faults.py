"""Disk faults on a local tier (issue 24, item 4): real errno failures injected into a trainer.

Each case runs ``disk_fault_child.py`` under ``fiu-run -x`` (Debian's ``fiu-utils``): the child
commits ``step_1``, then saves ``step_2`` through ``TieredWriter`` (``dcp.save``, and
``dcp.async_save`` in THREAD mode) while one POSIX call of the tier fails: ``write``, ``fsync``,
``rename`` or ``open`` with ``EIO``/``EACCES``, ``write`` returning short, or a real full tmpfs
(``ENOSPC``). The oracle, checked here with no fault loaded:

* the save fails (short writes: commits) with an error naming the tier, the file and what to do
  (for ``ENOSPC``, the bytes needed); ``async_save``'s future raises within its timeout;
* no temporary file is left in the tier, and ``step_2`` has no marker: an fsync error is never
  retried and trusted;
* ``latest_committed`` still names ``step_1``, and it restores bit-exact.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from tests.guarantees.disk_fault_child import train_state
from tests.system_tools import system_tool
from tierstore import TieredReader, TieredWriter, latest_committed, load_config
from tierstore.ids import marker_path
from tierstore.tiers.durable import is_temporary

CHILD = Path(__file__).with_name("disk_fault_child.py")
MODES = ["save", "async"]


@dataclass(frozen=True)
class Fault:
    """One libfiu failure point, the errno it sets and the tier calls it hits (see the child)."""

    point: str
    errno: str
    pattern: str
    names: str
    """A regex the error message must match: the file (or directory) the failing call was on."""
    remedy: str
    """A regex for the message's advice."""


EIO_ADVICE = r"check the device"
FAULTS = {
    "write-EIO": Fault("posix/io/rw/write", "EIO", r"^write\(.*\.distcp", r"r00000-\d\.distcp", EIO_ADVICE),
    "fsync-EIO-data": Fault(
        "posix/io/sync/fsync", "EIO", r"^open_write\(.*\.distcp", r"r00000-\d\.distcp", EIO_ADVICE
    ),
    "fsync-EIO-data-dir": Fault(
        "posix/io/sync/fsync", "EIO", r"^fsync_dir\(.* open_write\(.*distcp", r"r00000-\d\.distcp", EIO_ADVICE
    ),
    "fsync-EIO-metadata": Fault(
        "posix/io/sync/fsync", "EIO", r"^open_write\(.*\.metadata", r"\.metadata", EIO_ADVICE
    ),
    "fsync-EIO-marker": Fault(
        "posix/io/sync/fsync", "EIO", r"^publish\(.*commit\.json", r"step_2/commit\.json", EIO_ADVICE
    ),
    "fsync-EIO-marker-dir": Fault(
        "posix/io/sync/fsync",
        "EIO",
        r"^fsync_dir\(.* publish\(.*step_2/commit\.json",
        r"step_2/commit\.json",
        EIO_ADVICE,
    ),
    "rename-EIO": Fault(
        "posix/io/dir/rename", "EIO", r"^open_write\(.*\.distcp", r"r00000-\d\.distcp", EIO_ADVICE
    ),
    "open-EACCES": Fault(
        "posix/io/oc/open",
        "EACCES",
        # the open is made through durable.in_dirs (it makes the directory again if it vanished)
        r"^(<lambda>\([^)]*\) )?(in_dirs\([^)]*\) )?open_write\(.*\.distcp",
        r"r00000-\d\.distcp",
        r"check the permissions",
    ),
}


def fiu_run() -> str:
    """The ``fiu-run`` binary; a failure, not a skip, without it (``make test`` installs it)."""
    return system_tool("fiu-run")


def local_config(tmp_path: Path, root: Path) -> Path:
    """A config whose only tier is ``local`` at ``root``."""
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"tiers": [{"name": "local", "type": "local", "path": str(root)}]}))
    return path


def run_child(config: Path, mode: str, fault: Fault | None) -> dict[str, Any]:
    """Run the child trainer under ``fiu-run``; its JSON report."""
    point, error, pattern = (fault.point, fault.errno, fault.pattern) if fault else ("none", "-", "")
    done = subprocess.run(
        [fiu_run(), "-x", "-f", "", sys.executable, str(CHILD), str(config), mode, point, error, pattern],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-3000:]}"
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def temporary_files(root: Path) -> list[str]:
    """Every hidden temporary name left in the tier."""
    return [os.path.join(d, n) for d, _s, names in os.walk(root) for n in names if is_temporary(n)]


def assert_restores(config: Path, checkpoint_id: str, step: int) -> None:
    """``checkpoint_id`` loads back bit-exact to ``train_state(step)``."""
    expected = train_state(step)
    target: dict[str, Any] = {
        "w": torch.zeros_like(expected["w"]),
        "counts": torch.zeros_like(expected["counts"]),
        "blob": b"",
        "step": -1,
    }
    dcp.load(target, storage_reader=TieredReader(load_config(config)), checkpoint_id=checkpoint_id)
    for key in ("w", "counts"):
        assert target[key].view(torch.uint8).equal(expected[key].view(torch.uint8)), key
    assert (target["blob"], target["step"]) == (expected["blob"], expected["step"])


def assert_previous_intact(config: Path, root: Path) -> None:
    """No temp file, no marker for ``step_2``; ``step_1`` is the latest and restores bit-exact."""
    assert temporary_files(root) == [], "temporary files left in the tier"
    assert not (root / marker_path("step_2")).exists(), "a marker over a failed save"
    assert latest_committed(load_config(config), collective=False) == "step_1"
    assert_restores(config, "step_1", 1)


def assert_names(message: str, root: Path, *patterns: str) -> None:
    """The error names the tier (by name and root) and matches every pattern."""
    assert "tier local" in message and str(root) in message, message
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(FAULTS))
def test_a_disk_fault_fails_the_save_and_keeps_the_previous_checkpoint(
    tmp_path: Path, case: str, mode: str
) -> None:
    fault = FAULTS[case]
    root = tmp_path / "local"
    config = local_config(tmp_path, root)
    report = run_child(config, mode, fault)
    assert report["hits"], f"the fault never fired: {report}"
    assert report["outcome"] == "raised", report
    if fault.point.endswith("fsync"):  # the failed fsync is the last: never retried and trusted
        assert len(report["hits"]) == 1, report["hits"]
    assert_previous_intact(config, root)
    assert_names(report["message"], root, fault.names, fault.remedy)


@pytest.mark.parametrize("mode", MODES)
def test_short_writes_commit_the_exact_bytes(tmp_path: Path, mode: str) -> None:
    """``write`` taking only part of each buffer (libfiu's ``write/reduce``): every write is
    completed by the tier, and the checkpoint commits and restores bit-exact."""
    root = tmp_path / "local"
    config = local_config(tmp_path, root)
    short = Fault("posix/io/rw/write/reduce", "-", r"^write\(", "", "")
    report = run_child(config, mode, short)
    assert report["outcome"] == "committed", report
    assert any(".distcp" in hit for hit in report["hits"]), report["hits"]
    assert temporary_files(root) == []
    assert latest_committed(load_config(config), collective=False) == "step_2"
    assert_restores(config, "step_2", 2)
    assert_restores(config, "step_1", 1)


@pytest.mark.parametrize("mode", MODES)
def test_a_full_disk_fails_the_save_naming_the_bytes_needed(
    tmp_path: Path, mode: str, mount_tmpfs: Callable[[str], Path]
) -> None:
    """A real, small tmpfs: ``step_1`` (about 1.1 MB) fits, ``step_2`` does not."""
    root = mount_tmpfs("1700k")
    config = local_config(tmp_path, root)
    report = run_child(config, mode, None)
    assert report["outcome"] == "raised", report
    assert_previous_intact(config, root)
    assert_names(report["message"], root, r"No space left", r"needs? \d+ bytes", r"free space")


def test_an_unreadable_file_fails_the_restore_naming_tier_file_and_remedy(tmp_path: Path) -> None:
    """``open`` of the data files refused (EACCES) while ``step_1`` is restored: the load says
    which tier and file and what to do, and restores bit-exact once the file is readable again."""
    root = tmp_path / "local"
    config = local_config(tmp_path, root)
    unreadable = Fault("posix/io/oc/open", "EACCES", r"^read_into\(.*\.distcp", "", "")
    report = run_child(config, "load", unreadable)
    assert report["hits"] and report["outcome"] == "raised", report
    assert_names(
        report["message"],
        root,
        r"cannot read 'step_1/\S+/r00000-0\.distcp'",
        r"Permission denied",
        r"check the permissions",
    )
    assert latest_committed(load_config(config), collective=False) == "step_1"
    assert_restores(config, "step_1", 1)


def test_a_file_where_the_checkpoint_directory_goes_fails_the_save(tmp_path: Path) -> None:
    """A path component that is a regular file (a foreign ``step_2`` in the tier root): the save
    fails naming the tier, the path and what to do; ``step_1`` stays the latest."""
    root = tmp_path / "local"
    config = local_config(tmp_path, root)
    cfg = load_config(config)
    dcp.save(train_state(1), storage_writer=TieredWriter(cfg), checkpoint_id="step_1")
    (root / "step_2").write_text("not a directory")
    with pytest.raises(CheckpointException) as failed:
        dcp.save(train_state(2), storage_writer=TieredWriter(cfg), checkpoint_id="step_2")
    assert_names(str(failed.value), root, r"'step_2/", r"Not a directory", r"move it away")
    assert (root / "step_2").read_text() == "not a directory"
    assert temporary_files(root) == []
    assert latest_committed(cfg, collective=False) == "step_1"
    assert_restores(config, "step_1", 1)
