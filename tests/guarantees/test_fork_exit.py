"""A forked helper that exits normally must not clean up after its parent: the finalizers it
inherited (a stager's removal of its staging directory, a save's end of its write record) belong to
the parent (tierstore._platform.runtime.finalize)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_forked_child_exiting_normally_leaves_the_parents_files_and_records(tmp_path: Path) -> None:
    root = Path("/dev/shm") / f"tierstore-fork-exit-{tmp_path.name}"  # a memory tier is tmpfs
    root.mkdir()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.guarantees.fork_exit_child", str(root)],
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["removed"] == [], "the child's exit removed the parent's files"
    assert report["loaded"], "the parent's next save did not restore"
