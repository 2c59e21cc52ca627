"""``tierstore restore`` of a checkpoint saved on two mirrored nodes and promoted (issue 22, row 8).

Config ``memory`` (mirrored) -> ``shared``; ``step_1`` saved by 2 ranks on 2 simulated nodes, mirrored,
then promoted to the shared tier by each node's promoter. Each node's memory holds only its own files
and its partner's as mirrors, so the export failed on every node (exit 2): it read the mirrored files at
their owner paths, and never tried the shared copy. It now uses the fastest tier whose complete copy this
process can read, and the result loads with torch's own ``FileSystemReader``, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader

from tests.mirror_jobs import blank_state, memory_root, mirror_config, save_steps, shard_state
from tests.workers import run_ranks
from tierstore.ids import marker_path

ID = "step_1"


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )


@pytest.fixture(scope="module")
def mirrored_and_promoted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks on 2 nodes saved ``step_1`` (mirrored), then each node's promoter ran once."""
    root = tmp_path_factory.mktemp("export-mirrored")
    config = mirror_config(root, lower=("shared",))
    run_ranks(save_steps, 2, root, config, (0, 1), (1,), "sync", root)
    path = root / "tierstore.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    for node in (1, 0):  # node 1's part first; node 0 (the marker's node) then commits
        done = _cli(path, "--node", str(node), "promote", "--once")
        assert done.returncode == 0, done.stderr
    assert (root / "shared" / marker_path(ID)).exists()
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    """A private copy of the job's tiers and configuration (paths rewritten to the copy)."""
    root = tmp_path / "job"
    shutil.copytree(saved, root, symlinks=True, ignore=shutil.ignore_patterns("store-*"))
    text = (root / "tierstore.yaml").read_text().replace(str(saved), str(root))
    (root / "tierstore.yaml").write_text(text)
    return root


def _generation(root: Path) -> str:
    """The generation of ``step_1`` (the one save)."""
    return str(json.loads((root / "shared" / marker_path(ID)).read_text())["generation"])


def _assert_loads_the_saved_state(directory: Path) -> None:
    """Plain torch DCP (no tierstore reader) loads exactly what ranks 0 and 1 saved."""
    target = blank_state([0, 1])
    dcp.load(target, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    for rank in (0, 1):
        saved = shard_state(rank, 1)["model"][f"shard{rank}"]
        assert torch.equal(target["model"][f"shard{rank}"], saved), f"shard{rank} differs"
    assert torch.equal(target["model"]["replicated"], shard_state(0, 1)["model"]["replicated"])
    assert target["step"] == 1


@pytest.mark.parametrize("node", [0, 1])
def test_every_node_exports_a_mirrored_and_promoted_checkpoint(
    mirrored_and_promoted: Path, tmp_path: Path, node: int
) -> None:
    root = _copy(mirrored_and_promoted, tmp_path)
    out = tmp_path / f"export-node{node}"
    done = _cli(root / "tierstore.yaml", "--node", str(node), "restore", ID, "--to", str(out), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # Each node holds every file in memory (its own, and its partner's as verified mirrors).
    assert report["tier"] == "memory", report
    _assert_loads_the_saved_state(out)


def test_a_node_missing_its_partners_mirror_exports_from_the_shared_tier(
    mirrored_and_promoted: Path, tmp_path: Path
) -> None:
    root = _copy(mirrored_and_promoted, tmp_path)
    shutil.rmtree(memory_root(root, 0) / ".tierstore" / "mirror")  # node 1's files are gone here
    out = tmp_path / "export"
    done = _cli(root / "tierstore.yaml", "--node", "0", "restore", ID, "--to", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tier"] == "shared"
    _assert_loads_the_saved_state(out)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_mirror_copy_is_skipped_and_the_shared_tier_serves(
    mirrored_and_promoted: Path, tmp_path: Path
) -> None:
    """Mirror copies are checked against their CRC32C before they count: a flipped byte in node 1's
    file held by node 0 makes node 0's memory copy incomplete, and the shared tier serves."""
    root = _copy(mirrored_and_promoted, tmp_path)
    _flip_last_byte(
        memory_root(root, 0) / ".tierstore" / "mirror" / ID / _generation(root) / "r00001-0.distcp"
    )
    out = tmp_path / "export"
    done = _cli(root / "tierstore.yaml", "--node", "0", "restore", ID, "--to", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tier"] == "shared"
    _assert_loads_the_saved_state(out)


def test_a_corrupt_own_copy_found_while_converting_falls_back_to_the_shared_tier(
    mirrored_and_promoted: Path, tmp_path: Path
) -> None:
    """Own copies are chosen by size; the conversion's CRC32C check finds the flipped byte, and the
    export starts again from the next tier instead of failing."""
    root = _copy(mirrored_and_promoted, tmp_path)
    _flip_last_byte(memory_root(root, 0) / ID / _generation(root) / "r00000-0.distcp")
    out = tmp_path / "export"
    done = _cli(root / "tierstore.yaml", "--node", "0", "restore", ID, "--to", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tier"] == "shared"
    assert "r00000-0.distcp: CRC32C" in done.stderr, done.stderr  # the warning names the file
    _assert_loads_the_saved_state(out)


def test_no_usable_copy_fails_naming_every_tier(mirrored_and_promoted: Path, tmp_path: Path) -> None:
    root = _copy(mirrored_and_promoted, tmp_path)
    shutil.rmtree(memory_root(root, 0) / ".tierstore" / "mirror")
    shutil.rmtree(root / "shared" / ID)
    out = tmp_path / "export"
    done = _cli(root / "tierstore.yaml", "--node", "0", "restore", ID, "--to", str(out))
    assert done.returncode == 2, (done.stdout, done.stderr)
    message = done.stderr
    assert "no tier holds a usable committed copy of checkpoint 'step_1'" in message, message
    assert "memory" in message and "no verified copy" in message, message
    assert "shared" in message and "no commit marker" in message, message
    assert not out.exists()
