"""A shared tier on a mount that never answers (a Lustre or NFS hard mount whose server went away),
for real: a FUSE filesystem whose daemon answers nothing (``tests/hung_files.hung_mount``). Host
memory holds the newest checkpoint, so a restarted trainer needs nothing of the shared tier: from
``load_config`` to its first committed save it waits for that tier one ``probe_timeout``, and the
tools return within ``probe_timeout`` and their own work, naming the tier."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.guarantees.test_tier_health import ROOT, restart
from tests.hung_files import hung_mount, hung_mount_unavailable
from tierstore import TieredWriter, load_config

PROBE_TIMEOUT = 2.0
pytestmark = pytest.mark.skipif(bool(hung_mount_unavailable()), reason=hung_mount_unavailable() or "")


def write_config(tmp_path: Path) -> Path:
    """ram -> shared (under ``tmp_path/mnt``), with a short ``probe_timeout``; the YAML's path."""
    path = tmp_path / "tierstore.yaml"
    tiers = [
        {"name": "ram", "type": "memory", "path": str(tmp_path / "ram")},
        {"name": "lustre", "type": "shared", "path": str(tmp_path / "mnt" / "ckpt")},
    ]
    path.write_text(yaml.safe_dump({"tiers": tiers, "probe_timeout": f"{PROBE_TIMEOUT}s"}))
    return path


def saved_then_hung(tmp_path: Path) -> Path:
    """The config, a checkpoint committed in host memory, and the shared tier's mount point ready."""
    config_path = write_config(tmp_path)
    config = load_config(config_path)
    state = {"w": torch.ones(1000), "step": 7}
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="step_0007")
    return config_path


def test_a_restart_with_a_hung_shared_mount_waits_for_it_at_most_once(tmp_path: Path) -> None:
    """Before: ``load_config`` never returned (its ``mkdir`` and probe file on the mount)."""
    config_path = saved_then_hung(tmp_path)
    with hung_mount(tmp_path / "mnt"):
        result, log = restart(config_path)
    print(result, log, sep="\n")
    assert (result["restored"], result["tier"], result["step"]) == ("step_0007", "ram", 8)
    assert result["seconds"] < 1.5 * PROBE_TIMEOUT, result
    about_it = [line for line in log.splitlines() if line.startswith("WARNING") and "lustre" in line]
    assert len(about_it) == 1, about_it


@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["status"],
        ["verify", "step_0007"],
        ["verify", "--all"],
        ["gc", "--dry-run"],
        ["promote", "--once"],
    ],
)
def test_the_tools_return_with_a_hung_shared_mount_naming_it(tmp_path: Path, command: list[str]) -> None:
    config_path = saved_then_hung(tmp_path)
    argv = [sys.executable, "-m", "tierstore.cli", "--config", str(config_path), *command]
    with hung_mount(tmp_path / "mnt"):
        began = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        took = time.monotonic() - began
    said = done.stdout + done.stderr
    print(command, done.returncode, f"{took:.1f}s", said, sep="\n")
    assert "lustre" in said, said
    assert took < 3 * PROBE_TIMEOUT + 8, f"{command} took {took:.1f}s"  # + the CLI's start-up
