"""Mirror files that retention drops become the next round's spares: their pages exist already,
so the next round lands without allocating and zeroing fresh tmpfs pages
(``tierstore/dcp/mirror/spares.py``, ``tierstore/records/mirror.py``)."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.guarantees.test_peer_mirror_spares import spares_of
from tests.mirror_jobs import become, mirror_config, mirror_markers, shard_state
from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore.checksum import crc32c
from tierstore.config import Config
from tierstore.dcp.mirror.spares import Spares
from tierstore.ids import mirror_copy_path, mirror_marker_path
from tierstore.records.marker import FileEntry
from tierstore.records.mirror import MirrorMarker
from tierstore.records.mirror_retention import remove_mirror
from tierstore.tiers.memory import MemoryTier

MIB = 2**20
GEN = "g0000000000100000000"  # a well-formed generation name (is_generation)


def _data_files(root: Path, node: int, checkpoint_id: str) -> list[Path]:
    (marker,) = mirror_markers(root, node, checkpoint_id)
    return sorted(marker.parent.glob("*.distcp"))


def _settled_spares(root: Path, node: int, sizes: set[int]) -> dict[int, int]:
    """The node's spares once they are of ``sizes`` (spares are reserved after a round ends)."""
    deadline = time.monotonic() + 30
    while set(spares_of(root, node).values()) != sizes and time.monotonic() < deadline:
        time.sleep(0.05)
    return spares_of(root, node)


def save_three_checking_recycling(rank: int, world: int, config: Config, root: Path) -> None:
    """keep 1: step_2's round drops step_1's mirror, whose files must become the spares (no fresh
    reservation), and step_3's mirror must land in them, correct (its marker's CRC32C).

    The files of step_1 are held open meanwhile, so that their inodes cannot be freed and reused
    by a fresh file: the same inode number is the same file."""
    become(rank)
    writer = TieredWriter(config, node=rank)
    dcp.save(shard_state(rank, 1), storage_writer=writer, checkpoint_id="step_1")
    assert writer.wait_mirrored(60)
    first = _data_files(root, rank, "step_1")
    sizes = {p.stat().st_size for p in first}
    held = [os.open(p, os.O_RDONLY) for p in first]
    step_1 = {os.fstat(fd).st_ino for fd in held}
    _settled_spares(root, rank, sizes)
    dist.barrier()
    dcp.save(shard_state(rank, 2), storage_writer=writer, checkpoint_id="step_2")
    assert writer.wait_mirrored(60)
    assert mirror_markers(root, rank, "step_1") == [], "keep 1: step_1's mirror must be dropped"
    spares = _settled_spares(root, rank, sizes)
    assert set(spares) == step_1, f"spares {spares} are not step_1's dropped files {step_1}"
    dist.barrier()
    dcp.save(shard_state(rank, 3), storage_writer=writer, checkpoint_id="step_3")
    assert writer.wait_mirrored(60)
    (marker_file,) = mirror_markers(root, rank, "step_3")
    marker = MirrorMarker.from_json(marker_file.read_bytes(), where=str(marker_file))
    landed = _data_files(root, rank, "step_3")
    assert landed and {p.stat().st_ino for p in landed} <= step_1
    for path in landed:
        (entry,) = [e for e in marker.files if e.path.endswith(path.name)]
        data = path.read_bytes()
        assert len(data) == entry.size and crc32c(data) == entry.crc32c, path
    for fd in held:
        os.close(fd)
    writer.close()
    dist.barrier()


def test_files_retention_drops_are_the_next_rounds_landing_files(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), keep=1)
    run_ranks(save_three_checking_recycling, 2, tmp_path, config, tmp_path)
    for node in (0, 1):
        assert spares_of(tmp_path, node) == {}, "a finished process leaves no spare behind"
        assert len(mirror_markers(tmp_path, node, "step_3")) == 1


def _mirror_file(tier: MemoryTier, size: int, byte: int = 0xAB) -> str:
    """A received mirror file of ``size`` bytes (node 1's rank 1 file of ``x``), marker beside it."""
    entry = FileEntry(f"{GEN}/__1_0.distcp", size, 0, rank=1, node=1)
    path = mirror_copy_path("x", entry.path)
    tier.write_bytes(path, bytes([byte]) * size)
    marker = MirrorMarker("x", GEN, 1, 0, (1,), (entry,), 1, 0)
    tier.publish(mirror_marker_path("x", GEN, 1), marker.to_json(), create_only=False)
    return path


def test_a_dropped_mirror_leaves_its_marker_before_any_file_is_recycled(tmp_path: Path) -> None:
    """Marker first, then data: when a file leaves the mirror, no marker names it any more."""
    tier = MemoryTier("memory", str(tmp_path))
    path = _mirror_file(tier, MIB)
    seen: list[tuple[str, bool]] = []

    def recycle(file: str, size: int) -> bool:
        seen.append((file, tier.exists(mirror_marker_path("x", GEN, 1))))
        return False

    remove_mirror(tier, "x", GEN, 1, recycle=recycle)
    assert (path, False) in seen, seen
    assert not tier.exists(path)


def test_a_recycled_file_leaves_the_mirror_and_is_the_next_spare_of_its_size(tmp_path: Path) -> None:
    tier = MemoryTier("memory", str(tmp_path))
    spares = Spares(tier)
    path = _mirror_file(tier, 2 * MIB)
    inode = os.stat(tier.local_path(path)).st_ino
    spares.take(2 * MIB)
    assert spares.recycle(path, 2 * MIB)
    assert not tier.exists(path), "a recycled file is no checkpoint file any more"
    spare = spares.take(2 * MIB)
    assert spare is not None and os.stat(spare).st_ino == inode


def test_a_landing_in_a_longer_stale_spare_holds_the_new_bytes_only(tmp_path: Path) -> None:
    """Old bytes past the new file's end never become part of it: the landing ends at its size."""
    tier = MemoryTier("memory", str(tmp_path))
    spare = tmp_path / "spare"
    spare.write_bytes(bytes([0xAB]) * (2 * MIB))
    landing = tier.open_landing("mirror/y/new.distcp", MIB, str(spare))
    landing.write_at(0, memoryview(bytes([0x11]) * MIB))
    tier.adopt("mirror/y/new.distcp", landing.seal())
    assert tier.read_bytes("mirror/y/new.distcp") == bytes([0x11]) * MIB


def test_only_files_a_coming_round_can_use_are_recycled(tmp_path: Path) -> None:
    tier = MemoryTier("memory", str(tmp_path))
    spares = Spares(tier)
    path = _mirror_file(tier, MIB)
    spares.take(2 * MIB)  # this round wanted another size
    assert not spares.recycle(path, MIB)
    assert tier.exists(path), "a file not recycled is left for the caller to delete"


def recycle_against(tier: MemoryTier, keep_free: Callable[[int], int]) -> tuple[bool, int]:
    path = _mirror_file(tier, 8 * MIB)
    spares = Spares(tier)
    spares.take(8 * MIB)
    free = os.statvfs(tier.root).f_bavail * os.statvfs(tier.root).f_frsize
    spares.keep_free = keep_free(free)
    kept = spares.recycle(path, 8 * MIB)
    if not kept:
        tier.delete(path)
    return kept, os.statvfs(tier.root).f_bavail * os.statvfs(tier.root).f_frsize


def test_a_recycled_spare_never_takes_the_room_of_the_nodes_own_next_save(
    mount_tmpfs: Callable[[str], Path],
) -> None:
    """On a real 32 MiB tmpfs: holding the dropped file as a spare would leave less free than the
    node's own next save needs, so it is not kept (its room goes back); with room, it is."""
    tight = MemoryTier("memory", str(mount_tmpfs("32m")))
    kept, free = recycle_against(tight, lambda free: free + 1)
    assert not kept
    assert free >= 8 * MIB
    roomy = MemoryTier("memory", str(mount_tmpfs("32m")))
    kept, _ = recycle_against(roomy, lambda free: free - 4 * MIB)
    assert kept


def test_a_file_with_another_name_is_never_recycled(tmp_path: Path) -> None:
    """Its bytes would change under the other name: it is left for the caller to delete."""
    tier = MemoryTier("memory", str(tmp_path))
    spares = Spares(tier)
    path = _mirror_file(tier, MIB)
    other = tmp_path / "other-name"
    os.link(tier.local_path(path), other)
    spares.take(MIB)
    assert not spares.recycle(path, MIB)
    assert tier.exists(path) and other.read_bytes() == bytes([0xAB]) * MIB


def test_a_landing_in_a_shorter_spare_on_a_full_tmpfs_is_refused_at_its_start(
    mount_tmpfs: Callable[[str], Path],
) -> None:
    """A spare smaller than the file has no pages for the rest: the landing reserves them first,
    so a full tmpfs is an ENOSPC before any byte (never a late error or a SIGBUS), and the spare
    goes with the refusal."""
    root = mount_tmpfs("8m")
    tier = MemoryTier("memory", str(root))
    spare = root / "spare"
    spare.write_bytes(bytes([0xAB]) * MIB)
    with pytest.raises(OSError) as refused:
        tier.open_landing("mirror/y/new.distcp", 16 * MIB, str(spare))
    assert refused.value.errno == errno.ENOSPC
    assert not spare.exists()
