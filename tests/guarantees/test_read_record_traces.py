"""A restore's ``read`` record: written before the marker it protects is read, and gone with every
directory it made once the restore is over, so a load of an id saved nowhere leaves each tier as it
was (issue 38).

Real components: POSIX tier directories under ``tmp_path``, moto's S3 server; the order of file
operations is observed through Python's audit hooks, with nothing in tierstore patched.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter
from tierstore.config import Config
from tierstore.dcp.tools import export_checkpoint
from tierstore.errors import CheckpointNotFoundError
from tierstore.ids import ACTIVITY_DIR, marker_path
from tierstore.records.activity import hold, live
from tierstore.tiers.durable import in_dirs
from tierstore.tiers.posix import PosixTier


def _tree(root: Path) -> list[str]:
    """Every directory and file below ``root``, relative."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _objects(s3_client: Any, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))


def test_a_load_of_an_id_saved_nowhere_leaves_every_tier_as_it_was(
    make_config: Callable[..., Config], tmp_path: Path, s3_client: Any, s3_bucket: str
) -> None:
    """Host memory, a local disk and S3, all fresh: ``dcp.load`` and ``tierstore restore`` (the
    export) of an unknown id fail naming every tier, and afterwards no tier holds a new directory
    (``.tierstore/activity`` before the fix), record or object."""
    config = make_config("memory", "local", "s3")
    files, objects = _tree(tmp_path), _objects(s3_client, s3_bucket)
    with pytest.raises(BaseException, match="no tier holds a usable committed copy of checkpoint 'nobody'"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=TieredReader(config), checkpoint_id="nobody")
    assert _tree(tmp_path) == files and _objects(s3_client, s3_bucket) == objects
    with pytest.raises(CheckpointNotFoundError, match="no tier holds a usable committed copy"):
        export_checkpoint(config, "nobody", tmp_path / "out")
    assert _tree(tmp_path) == files and _objects(s3_client, s3_bucket) == objects


class _Opens:
    """The paths opened below ``root``, in order, while :attr:`on` (one audit hook per test: Python
    cannot remove one, so it is switched off after)."""

    def __init__(self, root: Path) -> None:
        self.root, self.on, self.paths = str(root), False, []
        self._lock = threading.Lock()
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.on or event != "open" or not args or not isinstance(args[0], (str, os.PathLike)):
            return
        path = os.fsencode(args[0]).decode(errors="replace")
        if path.startswith(self.root):
            with self._lock:
                self.paths.append(os.path.relpath(path, self.root))


@pytest.mark.parametrize("activity_dir", ["kept", "absent"])
def test_a_restore_announces_itself_before_it_reads_the_marker(
    make_config: Callable[..., Config], tmp_path: Path, activity_dir: str
) -> None:
    """The record (its temp file) is opened before the marker: retention cannot delete the copy
    after the restore trusted its marker. Also where ``.tierstore/activity`` is absent (a copy put
    there by hand): the record makes it first, and takes it away again after the load."""
    config = make_config("local")
    dcp.save({"w": torch.ones(4)}, storage_writer=TieredWriter(config), checkpoint_id="x")
    root = Path(config.make_tier("local", node=0).root)
    if activity_dir == "absent":
        shutil.rmtree(root / ACTIVITY_DIR)
    before = _tree(root)
    opens = _Opens(root)
    target = {"w": torch.zeros(4)}
    opens.on = True
    try:
        dcp.load(target, storage_reader=TieredReader(config), checkpoint_id="x")
    finally:
        opens.on = False
    assert torch.equal(target["w"], torch.ones(4))
    record = next(i for i, p in enumerate(opens.paths) if p.startswith(f"{ACTIVITY_DIR}/.read~x~"))
    marker = opens.paths.index(marker_path("x"))
    assert record < marker, opens.paths
    assert _tree(root) == before


def test_a_reader_removes_only_empty_directories_it_made(tmp_path: Path) -> None:
    """Two restores at once in a fresh tier: the first made ``.tierstore/activity``; its release
    leaves the second's record (and so the directory) in place; the second made nothing."""
    tier = PosixTier("local", "local", str(tmp_path), node_local=True)
    first = hold(tier, "read", "x", None, ttl=60)
    second = hold(tier, "read", "x", None, ttl=60)
    assert first.made == (ACTIVITY_DIR, ".tierstore") and second.made == ()
    first.release()
    assert [a.path for a in live(tier, ttl=60)] == [second.path], "a live reader lost its record"
    second.release()
    assert live(tier, ttl=60) == [] and (tmp_path / ACTIVITY_DIR).is_dir()


def test_a_write_into_a_directory_removed_meanwhile_makes_it_again(tmp_path: Path) -> None:
    """A reader's release empties and removes ``.tierstore/activity`` right after another process
    made it and before that process's file is created in it: the file is created all the same."""
    directory = tmp_path / ".tierstore" / "activity"
    tries: list[int] = []

    def create() -> int:
        if not tries:
            directory.rmdir()  # the other process's rmdir, between the mkdir and the open
            directory.parent.rmdir()
        tries.append(1)
        return os.open(directory / "record", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    os.close(in_dirs(directory, create))
    assert len(tries) == 2 and (directory / "record").is_file()
    gone = tmp_path / "gone"
    with pytest.raises(FileNotFoundError):  # a missing source where the directory exists: at once
        in_dirs(directory, lambda: os.rename(gone, directory / "moved"))
