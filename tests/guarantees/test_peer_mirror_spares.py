"""Landing files reserved between mirror rounds: the next round's files land in them, and they go
with their process (``tierstore/dcp/mirror/spares.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.mirror_jobs import become, memory_root, mirror_config, mirror_markers, shard_state
from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore.config import Config


def spares_of(root: Path, node: int) -> dict[int, int]:
    """Inode -> size of every spare landing file ``node``'s memory tier holds."""
    found = memory_root(root, node).glob(".tierstore/staging/*/mirror-spare-*")
    return {path.stat().st_ino: path.stat().st_size for path in found}


def received_inodes(root: Path, node: int, checkpoint_id: str) -> dict[str, int]:
    """File name -> inode of every data file of a mirror ``node`` holds of ``checkpoint_id``."""
    (marker,) = mirror_markers(root, node, checkpoint_id)
    return {p.name: p.stat().st_ino for p in marker.parent.glob("*.distcp")}


def save_twice_checking_spares(rank: int, world: int, config: Config, root: Path) -> None:
    """Node ``rank`` saves step_1, waits for spares of what it received, saves step_2 (the same
    shapes), and checks that step_2's mirror files are those spares, renamed into place."""
    become(rank)
    writer = TieredWriter(config, node=rank)
    dcp.save(shard_state(rank, 1), storage_writer=writer, checkpoint_id="step_1")
    assert writer.wait_mirrored(60)
    received = {os.stat(p).st_size for p in _paths(root, rank, "step_1")}
    deadline = time.monotonic() + 30  # spares are reserved after the round, between rounds
    while set(spares_of(root, rank).values()) != received and time.monotonic() < deadline:
        time.sleep(0.05)
    spares = spares_of(root, rank)
    assert set(spares.values()) == received, (spares, received)
    dist.barrier()
    dcp.save(shard_state(rank, 2), storage_writer=writer, checkpoint_id="step_2")
    assert writer.wait_mirrored(60)
    landed = received_inodes(root, rank, "step_2")
    assert landed and set(landed.values()) <= set(spares), (landed, spares)
    writer.close()
    dist.barrier()


def _paths(root: Path, node: int, checkpoint_id: str) -> list[Path]:
    (marker,) = mirror_markers(root, node, checkpoint_id)
    return list(marker.parent.glob("*.distcp"))


def test_the_next_round_lands_in_spares_reserved_after_the_last_and_they_go_at_exit(
    tmp_path: Path,
) -> None:
    config = mirror_config(tmp_path, lower=(), keep=2)
    run_ranks(save_twice_checking_spares, 2, tmp_path, config, tmp_path)
    for node in (0, 1):
        assert spares_of(tmp_path, node) == {}, "a finished process leaves no spare behind"
        assert len(mirror_markers(tmp_path, node, "step_2")) == 1
