"""Review of recycled mirror files (``tierstore/records/mirror.py``, ``tierstore/dcp/mirror/spares.py``):
a restore that chose a peer mirror copy keeps it until its data is read, even when the holder's
retention (whose snapshot of the live ``read`` records predates the restore) drops that mirror
meanwhile and would recycle its files as the next round's landing files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tests.mirror_jobs import (
    become,
    blank_state,
    load_and_check,
    memory_root,
    mirror_config,
    save_steps,
    shard_state,
)
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter
from tierstore.checksum import crc32c
from tierstore.config import Config
from tierstore.dcp.mirror.spares import Spares
from tierstore.ids import marker_path, mirror_copy_path, mirror_marker_path
from tierstore.promote.cleanup import find_leftovers, remove
from tierstore.promote.sidecar import Promoter
from tierstore.records.activity import Activity, hold, live
from tierstore.records.marker import FileEntry
from tierstore.records.mirror import MIRROR_MARKER_PREFIX, MirrorMarker, held_mirrors
from tierstore.records.mirror_retention import prune_mirrors
from tierstore.signing import MarkerTrust
from tierstore.tiers.memory import MemoryTier

MIB = 2**20


def _retention_of_the_next_round(tier: MemoryTier, readers: list[Any]) -> list[str]:
    """What a holder's mirror thread does once the next round's marker is down (``_conclude``),
    with ``readers`` its snapshot of the live ``read`` records, then the round after it: keep 1
    drops ``step_1``'s mirror, its files recycled as spares, and the next files land in them."""
    (marker,) = held_mirrors(tier, "step_1")
    spares = Spares(tier)
    for entry in marker.files:
        spares.take(entry.size)  # this round received files of these sizes
    removed = prune_mirrors(tier, 1, readers=readers, recycle=spares.recycle)
    for number, entry in enumerate(marker.files):  # the next round lands
        spare = spares.take(entry.size)
        if spare is None:
            continue
        path = f".tierstore/mirror/step_9/{'9' * 16}/landed-{number}"
        landing = tier.open_landing(path, entry.size, spare)
        landing.write_at(0, memoryview(b"\x5a" * entry.size))
        tier.adopt(path, landing.seal())
    return removed


class _RetentionDuringTheLoad(DefaultLoadPlanner):
    """Runs the holder's retention after the reader chose its copy, before it reads the data."""

    def __init__(self, tier: MemoryTier, readers: list[Any]) -> None:
        super().__init__()
        self.tier, self.readers, self.removed = tier, readers, []

    def create_local_plan(self) -> Any:
        self.removed = _retention_of_the_next_round(self.tier, self.readers)
        return super().create_local_plan()


def load_while_retention_recycles(rank: int, world: int, config: Config, root: Path) -> None:
    """Node 0, alone (world size 1): its own shard and node 1's from the mirror node 0 holds."""
    become(0)
    tier = MemoryTier("memory", str(memory_root(root, 0)))
    snapshot = [a for a in live(tier) if a.kind == "read"]  # taken before the restore began
    planner = _RetentionDuringTheLoad(tier, snapshot)
    target = blank_state([0, 1])
    reader = TieredReader(config, node=0)
    dcp.load(target, storage_reader=reader, checkpoint_id="step_1", planner=planner)
    assert reader.chosen_tier == "memory"
    for saved in (0, 1):
        expected = shard_state(saved, 1)["model"][f"shard{saved}"]
        assert torch.equal(target["model"][f"shard{saved}"], expected), f"shard{saved} differs"


def test_a_mirror_a_restore_chose_is_not_recycled_under_it(tmp_path: Path) -> None:
    """The restore announced itself (a ``read`` record) before it looked at the mirror, but after
    the holder's retention took its snapshot of the readers: the retention drops the mirror (its
    marker goes) yet must leave its files to the restore, which then loads every shard correctly,
    instead of failing on a file renamed away and overwritten by the next round's bytes. (The
    data read has no fallback: a failure there fails the load, even with a complete copy in the
    shared tier, as here.)"""
    config = mirror_config(tmp_path, lower=("shared",), keep=2)
    run_ranks(save_steps, 2, tmp_path, config, [0, 1], [1, 2], "sync", tmp_path)
    for node in (0, 1):
        Promoter(config, node=node).run_once()
    assert (tmp_path / "shared" / marker_path("step_1")).exists(), "a complete copy below"
    run_ranks(load_while_retention_recycles, 1, tmp_path, config, tmp_path)


def _generation(seq: int) -> str:
    return f"g{seq:016x}"


def _mirror_of(tier: MemoryTier, checkpoint_id: str, seq: int, size: int = MIB, files: int = 1) -> str:
    """A mirror of ``checkpoint_id`` (commit ``seq``): ``files`` files of node 1's, its marker
    beside them. Returns the first file's path."""
    generation = _generation(seq)
    entries = tuple(FileEntry(f"{generation}/__1_{n}.distcp", size, 0, rank=1, node=1) for n in range(files))
    for entry in entries:
        tier.write_bytes(mirror_copy_path(checkpoint_id, entry.path), bytes([0xAB]) * size)
    marker = MirrorMarker(checkpoint_id, generation, 1, 0, (1,), entries, seq, 0)
    tier.publish(mirror_marker_path(checkpoint_id, generation, 1), marker.to_json(), create_only=False)
    return mirror_copy_path(checkpoint_id, entries[0].path)


class _ReaderArrivesAsTheMarkerGoes(MemoryTier):
    """A restore announces itself (and reads the mirror marker, still there) just before the
    retention's delete of that marker lands."""

    def __init__(self, root: Path) -> None:
        super().__init__("memory", str(root))
        self.arrived: list[Activity] = []

    def delete(self, path: str) -> None:
        if path.rsplit("/", 1)[-1].startswith(MIRROR_MARKER_PREFIX) and not self.arrived:
            self.arrived.append(hold(self, "read", "x", None, ttl=60))
        super().delete(path)


def test_retention_rechecks_the_readers_after_the_marker_is_gone(tmp_path: Path) -> None:
    """Marker first, then the readers, then the files: a restore whose ``read`` record was not in
    the retention's snapshot, but which may have seen the marker, keeps the files it reads. With
    the readers looked at only before the marker is deleted, the files would be recycled."""
    tier = _ReaderArrivesAsTheMarkerGoes(tmp_path)
    path = _mirror_of(tier, "x", 1)
    newer = _mirror_of(tier, "y", 2)
    spares = Spares(tier)
    spares.take(MIB)
    try:
        removed = prune_mirrors(tier, 1, readers=[], recycle=spares.recycle)
        assert removed == [f"x/{_generation(1)}"], removed
        assert not tier.exists(mirror_marker_path("x", _generation(1), 1)), "the mirror is dropped"
        assert tier.exists(path), "a file a restore may be reading was recycled or deleted"
        assert tier.read_bytes(path) == bytes([0xAB]) * MIB
        assert spares.take(MIB) is None, "nothing was recycled"
    finally:
        for activity in tier.arrived:
            activity.release()
    assert tier.exists(newer)


_KILLED_WHILE_RECYCLING = """
import os, signal, sys
from tierstore.dcp.mirror.spares import Spares
from tierstore.promote.cleanup import find_leftovers, remove
from tierstore.promote.sidecar import Promoter
from tierstore.records.mirror_retention import prune_mirrors
from tierstore.tiers.memory import MemoryTier

tier = MemoryTier("memory", sys.argv[1])
spares = Spares(tier)
for _ in range(2):
    spares.take(2**20)  # the round received two files of this size

def recycle(path, size):
    taken = spares.recycle(path, size)
    assert taken, path
    print("recycled", path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # between one file's recycling and the next's
    return taken

prune_mirrors(tier, 1, recycle=recycle)
"""


def test_a_holder_killed_between_two_recycled_files_leaves_no_mirror_and_no_spare_for_good(
    tmp_path: Path,
) -> None:
    """kill -9 after the first of a dropped mirror's two files became a spare: no marker names a
    file of that mirror any more, the newer mirror is whole, and cleanup takes both the dead
    process's spare and the file left in the mirror directory (nothing held for good)."""
    tier = MemoryTier("memory", str(tmp_path))
    _mirror_of(tier, "x", 1, files=2)
    newer = _mirror_of(tier, "y", 2)
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_RECYCLING, str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.startswith("recycled"), done.stdout
    assert held_mirrors(tier, "x") == [], "a committed mirror names a recycled file"
    assert [m.checkpoint_id for m in held_mirrors(tier, "y")] == ["y"]
    assert tier.read_bytes(newer) == bytes([0xAB]) * MIB
    spares = list(tmp_path.glob(".tierstore/staging/*/mirror-spare-*"))
    assert [p.stat().st_size for p in spares] == [MIB], spares
    left = [info.path for info in tier.find(".tierstore/mirror/x")]
    assert len(left) == 1 and left[0].endswith(".distcp"), left
    found = find_leftovers(tier, stale_after=0, activity_ttl=60, trust=MarkerTrust())
    for cleanup in found:
        remove(tier, cleanup, trust=MarkerTrust())
    assert list(tmp_path.glob(".tierstore/staging/*/mirror-spare-*")) == [], found
    assert tier.find(".tierstore/mirror/x") == [], found
    assert tier.read_bytes(newer) == bytes([0xAB]) * MIB, "cleanup took the newer mirror"


TWO_NODES = (0, 0, 1, 1)


def save_overwrite_and_prune(rank: int, world: int, config: Config, root: Path) -> None:
    """Two ranks per node, keep 1: ``step_1``, ``step_2``, ``step_3`` twice (an overwrite), then
    ``step_4``; each round drops the last mirror (a stale generation for the overwrite), while
    each node's promoter runs a pass (its own mirror retention and gc) as the exchange runs (it
    may drop the mirror first: then it deletes, it does not recycle). The overwrite's round drops
    the replaced generation's mirror, and ``step_4``'s round lands in its recycled files (the
    promoter passes after these two)."""
    node = TWO_NODES[rank]
    become(node)
    writer = TieredWriter(config, node=node, overwrite=True)
    held: list[int] = []
    for number, step in enumerate((1, 2, 3, 3, 4)):
        dcp.save(shard_state(rank, step), storage_writer=writer, checkpoint_id=f"step_{step}")
        if rank % 2 == 0 and number < 3:  # later: after the rounds, which must recycle themselves
            Promoter(config, node=node).run_once()
        assert writer.wait_mirrored(120)
        dist.barrier()
        if number == 2 and rank % 2 == 0:  # held open: their inodes cannot be reused by new files
            held = [os.open(p, os.O_RDONLY) for p in _mirror_data(root, node, "step_3")]
    if rank % 2 == 0:
        Promoter(config, node=node).run_once()
    if held:  # the node's first rank runs retention: step_4 landed in the replaced step_3's
        step_3 = {os.fstat(fd).st_ino for fd in held}
        landed = {p.stat().st_ino for p in _mirror_data(root, node, "step_4")}
        assert landed & step_3, f"nothing recycled: {landed} {step_3}"
        for fd in held:
            os.close(fd)
    writer.close()
    dist.barrier()


def _mirror_data(root: Path, node: int, checkpoint_id: str) -> list[Path]:
    return sorted(memory_root(root, node).glob(f".tierstore/mirror/{checkpoint_id}/*/*.distcp"))


def test_two_ranks_a_node_overwrites_and_promoter_passes_keep_every_mirror_whole(tmp_path: Path) -> None:
    """After the rounds, each node holds one mirror (``step_4``'s), whose every file matches its
    marker's CRC32C though it landed in recycled files; no spare outlives its process, and node 0
    alone restores every saved rank's shard of ``step_4`` from its memory (own and mirror)."""
    config = mirror_config(tmp_path, lower=(), keep=1)
    run_ranks(save_overwrite_and_prune, 4, tmp_path, config, tmp_path)
    for node in (0, 1):
        tier = MemoryTier("memory", str(memory_root(tmp_path, node)))
        held = [m for i in ("step_1", "step_2", "step_3", "step_4") for m in held_mirrors(tier, i)]
        assert [m.checkpoint_id for m in held] == ["step_4"], held
        for entry in held[0].files:
            data = tier.read_bytes(mirror_copy_path("step_4", entry.path))
            assert (len(data), crc32c(data)) == (entry.size, entry.crc32c), entry.path
        assert [p.name for p in (memory_root(tmp_path, node) / ".tierstore/mirror").iterdir()] == ["step_4"]
        assert not list(memory_root(tmp_path, node).glob(".tierstore/staging/*/mirror-spare-*"))
    run_ranks(load_and_check, 1, tmp_path, config, [0], 4, "memory", [0, 1, 2, 3])
