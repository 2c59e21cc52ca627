"""A sidecar in its own PID namespace (a separate container) never mistakes a live trainer for a
dead one: the staging buffers of a writer that is alive survive its cleanup, whatever their age."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.system_tools import system_tool
from tierstore import TieredWriter
from tierstore.config import Config


def unshare_works() -> bool:
    """``unshare --pid`` needs CAP_SYS_ADMIN: a container without it skips, saying so."""
    probe = subprocess.run(
        [system_tool("unshare"), "--pid", "--fork", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


def gc_in_its_own_pid_namespace(config_file: Path) -> subprocess.CompletedProcess[str]:
    """``tierstore gc`` as a sidecar container runs it: in a PID namespace of its own."""
    gc = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            sys.executable,
            "-m",
            "tierstore.cli",
            "--config",
            str(config_file),
            "gc",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert gc.returncode == 0, gc.stderr
    return gc


@pytest.mark.skipif(not unshare_works(), reason="needs unshare(1) with CAP_SYS_ADMIN (root)")
def test_cleanup_in_another_pid_namespace_keeps_a_live_writers_buffers(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", promote={"stale_after": 0})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    writer = TieredWriter(config)
    state = {"w": torch.arange(100_000.0)}
    dcp.async_save(state, storage_writer=writer, checkpoint_id="step_000001").result()
    (memory,) = config.make_tiers(node=0)
    staging = Path(memory.local_path(".tierstore/staging") or "")
    before = sorted(p.name for p in staging.rglob("*"))
    assert any(name.startswith("slab-") for name in before), "the spare buffer is staged here"

    gc = gc_in_its_own_pid_namespace(path)
    assert sorted(p.name for p in staging.rglob("*")) == before, gc.stdout

    dcp.async_save(state, storage_writer=writer, checkpoint_id="step_000002").result()
    writer.close()


WRITER = """
import sys, time, torch, torch.distributed.checkpoint as dcp
from tierstore import TieredWriter
writer = TieredWriter(sys.argv[1])
dcp.async_save({"w": torch.arange(100_000.0)}, storage_writer=writer, checkpoint_id="step_1").result()
print("saved", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not unshare_works(), reason="needs unshare(1) with CAP_SYS_ADMIN (root)")
def test_cleanup_in_another_pid_namespace_removes_a_killed_writers_buffers(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", promote={"stale_after": 3600})  # age alone would keep them
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "saved"
    finally:
        writer.kill()  # SIGKILL: no finaliser runs; only the kernel lets go of its lock
        writer.wait()
    (memory,) = config.make_tiers(node=0)
    staging = Path(memory.local_path(".tierstore/staging") or "")
    assert list(staging.iterdir()), "the killed writer left its staging directory"
    gc = gc_in_its_own_pid_namespace(path)
    assert list(staging.iterdir()) == [], gc.stdout
    assert "staging buffers of a writer process that is gone" in gc.stdout
