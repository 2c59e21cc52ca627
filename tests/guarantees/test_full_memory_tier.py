"""A memory tier too small for the next save: a clear error on the trainer's thread, never SIGBUS.

Staging copies into a file on the memory tier's tmpfs. Were its pages left to be faulted in by the
copy, a full tmpfs would kill the trainer with SIGBUS; the saves run in a child process here so that
such a death shows as a signal exit code instead of taking pytest down.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import yaml

SAVE_TWICE = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    from tierstore import TieredWriter, TierUnavailableError

    writer = TieredWriter(sys.argv[1])
    for step in (1, 2):
        state = {"w": torch.full((int(sys.argv[2]) // 4,), float(step))}
        try:
            dcp.async_save(state, storage_writer=writer, checkpoint_id=f"step_{step}").result()
            print(f"step_{step} committed", flush=True)
        except TierUnavailableError as exc:
            print(f"step_{step} refused: {exc}", flush=True)
""")


def run_saves(tmp_path: Path, memory: Path, nbytes: int) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "tierstore.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"name": "ram", "type": "memory", "path": str(memory)}]}))
    return subprocess.run(
        [sys.executable, "-c", SAVE_TWICE, str(config), str(nbytes)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_save_that_cannot_fit_is_refused_naming_path_and_bytes(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path]
) -> None:
    memory = mount_tmpfs("4m")
    done = run_saves(tmp_path, memory, 6 * 2**20)
    assert done.returncode == 0, f"the trainer died (exit {done.returncode}): {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("step_1 refused: ") and str(memory) in lines[0], lines
    assert "needs 6291520 bytes" in lines[0], lines


def test_a_save_that_fits_only_once_commits_then_refuses_the_next(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path]
) -> None:
    # 6 MiB into 10 MiB: the first slab fits; with it kept as the checkpoint, the second cannot.
    memory = mount_tmpfs("10m")
    done = run_saves(tmp_path, memory, 6 * 2**20)
    assert done.returncode == 0, f"the trainer died (exit {done.returncode}): {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines[0] == "step_1 committed", lines
    assert lines[1].startswith("step_2 refused: "), lines
