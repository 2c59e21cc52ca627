"""Landing files reserved between mirror rounds: the next round's files land in them, and they go
with their process (``tierstore/dcp/mirror/spares.py``)."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.mirror_jobs import become, memory_root, mirror_config, mirror_markers, shard_state
from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore.checksum import crc32c
from tierstore.config import Config
from tierstore.dcp.layout import memory_of
from tierstore.dcp.mirror.spares import Spares
from tierstore.dcp.mirror.transport import post_send, receive_file, wait_all
from tierstore.errors import TierUnavailableError
from tierstore.records.marker import FileEntry
from tierstore.tiers.memory import MemoryTier

MIB = 2**20


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


def test_the_next_round_lands_in_spares_reserved_after_the_last_and_they_go_at_exit(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), keep=2)
    run_ranks(save_twice_checking_spares, 2, tmp_path, config, tmp_path)
    for node in (0, 1):
        assert spares_of(tmp_path, node) == {}, "a finished process leaves no spare behind"
        assert len(mirror_markers(tmp_path, node, "step_2")) == 1


@contextlib.contextmanager
def memory_tmpfs(root: Path, nodes: int, size: str) -> Iterator[None]:
    """Each simulated node's memory tier on a real tmpfs of ``size`` (root only, else a skip)."""
    mounted: list[Path] = []
    try:
        for node in range(nodes):
            where = memory_root(root, node)
            where.mkdir(parents=True)
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                capture_output=True,
                check=False,
            )
            if done.returncode:
                pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode()}")
            mounted.append(where)
        yield
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _free(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def refill_together(rank: int, world: int, root: Path, keep_free: int, size: int) -> None:
    """Two processes of one node refill a spare of ``size`` each at the same moment, against the
    same ``keep_free``, several times over; rank 0 checks what they left free each time."""
    spares = Spares(MemoryTier("memory", str(root)))
    spares.keep_free = keep_free
    for trial in range(5):
        spares.take(size)
        dist.barrier()
        spares.refill()
        dist.barrier()
        if rank == 0:
            free = _free(root)
            assert free >= keep_free, f"trial {trial}: spares left {free} free, {keep_free} needed"
        dist.barrier()
        spares.refill()  # nothing taken since: the spare goes
        dist.barrier()


def test_the_spares_of_all_ranks_of_a_node_leave_its_next_save_its_room(tmp_path: Path) -> None:
    """Room for one spare beyond keep_free, two ranks that each want one: exactly one is made."""
    with memory_tmpfs(tmp_path, 1, "64m"):
        run_ranks(refill_together, 2, tmp_path, memory_root(tmp_path, 0), 24 * MIB, 32 * MIB)


SIZES = {1: 4 * 2**20, 2: 8 * 2**20}
"""Floats per shard of each step: 16 MiB per rank, then 32 MiB (the shapes changed)."""


def grow_after_spares(rank: int, world: int, config: Config, root: Path) -> None:
    """Save step_1, wait for spares of its sizes, save step_2 of larger shapes; each node records
    whether step_2 got its mirror."""
    become(rank)
    writer = TieredWriter(config, node=rank)
    dcp.save(shard_state(rank, 1, SIZES[1]), storage_writer=writer, checkpoint_id="step_1")
    assert writer.wait_mirrored(60)
    deadline = time.monotonic() + 30
    while not spares_of(root, rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spares_of(root, rank), "no spare after step_1"
    dist.barrier()
    dcp.save(shard_state(rank, 2, SIZES[2]), storage_writer=writer, checkpoint_id="step_2")
    writer.wait_mirrored(60)
    writer.close()
    dist.barrier()


def test_spares_of_the_last_rounds_sizes_never_refuse_a_mirror_that_fits_without_them(tmp_path: Path) -> None:
    """120 MiB per node: step_2's own 32 MiB, the partner's 32 MiB and step_1's own 16 MiB fit,
    with step_1's unusable 16 MiB spare besides they would not."""
    with memory_tmpfs(tmp_path, 2, "120m"):
        run_ranks(grow_after_spares, 2, tmp_path, mirror_config(tmp_path, lower=(), keep=1), tmp_path)
        for node in (0, 1):
            assert len(mirror_markers(tmp_path, node, "step_2")) == 1, f"node {node}: no mirror"


def fail_a_receive_after_taking_a_spare(rank: int, world: int, root: Path) -> None:
    """Rank 1 sends a file; rank 0 takes a spare for it and runs out of file descriptors before
    the spare is opened as its landing (a real EMFILE): the spare must not stay behind, untracked,
    until the process ends."""
    data = torch.arange(MIB, dtype=torch.int32).to(torch.uint8)
    entry = FileEntry("0/__1_0.distcp", MIB, crc32c(memory_of(data)), rank=1, node=1)
    if rank == 1:
        wait_all(post_send(data, 0, dist.group.WORLD, 1), 60)
        return
    spares = Spares(MemoryTier("memory", str(root)))
    spares.take(MIB)
    spares.refill()
    assert sorted(spares_of(root.parent.parent, 0).values()) == [MIB]
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)  # the number the next open gets
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, limits[1]))  # now over the limit
    try:
        with pytest.raises(TierUnavailableError, match="cannot take the peer mirror"):
            receive_file(
                spares.tier,
                "mirror/x/0/__1_0.distcp",
                entry,
                1,
                dist.group.WORLD,
                first_tag=1,
                timeout_s=60,
                spares=spares,
            )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert spares_of(root.parent.parent, 0) == {}, "the taken spare stayed behind"


def test_a_receive_that_fails_before_landing_removes_the_spare_it_took(tmp_path: Path) -> None:
    root = memory_root(tmp_path, 0)
    root.mkdir(parents=True)
    run_ranks(fail_a_receive_after_taking_a_spare, 2, tmp_path, root)
