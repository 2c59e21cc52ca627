"""On a tmpfs, a mirror's spare landing files are mapped between rounds and gloo receives straight
into them: the bytes are checked (CRC32C) before the file gets its name, and the mapping is gone by
then, so no committed file is ever mapped writable (``tierstore/dcp/mirror/spares.py``,
``transport.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.guarantees.test_peer_mirror_spares import fail_a_receive_after_taking_a_spare, spares_of
from tests.mirror_jobs import memory_root
from tests.process_files import mapped_inodes
from tests.workers import run_ranks
from tierstore.checksum import crc32c
from tierstore.dcp.layout import memory_of
from tierstore.dcp.mirror.spares import Spares
from tierstore.dcp.mirror.transport import CHUNK, post_send, receive_file, wait_all
from tierstore.errors import IntegrityError
from tierstore.records.marker import FileEntry
from tierstore.tiers.landing import Landing
from tierstore.tiers.memory import MemoryTier

MIB = 2**20
SIZE = CHUNK + 3 * MIB + 5  # two messages, the second one short
LANDED = "mirror/x/0/__1_0.distcp"


def one_mapped_spare(root: Path, size: int) -> tuple[MemoryTier, Spares, int]:
    """Node 0's memory tier at ``root`` (``memory_root``, on a tmpfs) with one spare of ``size``
    reserved by a refill, checked to be mapped; the spare's inode."""
    tier = MemoryTier("memory", str(root))
    spares = Spares(tier)
    spares.take(size)
    spares.refill()
    ((inode, _size),) = spares_of(root.parent.parent, 0).items()
    assert inode in mapped_inodes(), "a spare on a tmpfs is mapped when it is made"
    return tier, spares, inode


def payload() -> torch.Tensor:
    return (torch.arange(SIZE, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def receive_through_a_mapping(rank: int, world: int, root: Path, corrupt: bool) -> None:
    """Rank 1 sends a file; rank 0 receives it into a spare reserved (and mapped) beforehand,
    counting the copies made into the landing (none: gloo wrote into the mapping)."""
    data = payload()
    value = crc32c(memory_of(data)) ^ (1 if corrupt else 0)
    entry = FileEntry("0/__1_0.distcp", SIZE, value, rank=1, node=1)
    if rank == 1:
        wait_all(post_send(data, 0, dist.group.WORLD, 1), 60)
        return
    tier, spares, spare_inode = one_mapped_spare(root, SIZE)
    copies: list[int] = []
    write_at = Landing.write_at

    def counted(self: Landing, offset: int, piece: memoryview) -> None:
        copies.append(len(piece))
        write_at(self, offset, piece)

    Landing.write_at = counted  # type: ignore[method-assign]  # a spy: it still writes
    mapped_at_adopt: list[bool] = []
    adopt = tier.adopt

    def adopt_watched(path: str, source_file: str) -> None:
        mapped_at_adopt.append(os.stat(source_file).st_ino in mapped_inodes())
        adopt(path, source_file)

    tier.adopt = adopt_watched  # type: ignore[method-assign]  # a spy: it still adopts
    try:
        if corrupt:
            with pytest.raises(IntegrityError, match="received CRC32C"):
                receive_file(
                    tier, LANDED, entry, 1, dist.group.WORLD, first_tag=1, timeout_s=60, spares=spares
                )
        else:
            receive_file(tier, LANDED, entry, 1, dist.group.WORLD, first_tag=1, timeout_s=60, spares=spares)
    finally:
        Landing.write_at = write_at  # type: ignore[method-assign]
    assert copies == [], "the bytes were copied into the landing, not received into its mapping"
    assert mapped_at_adopt == ([] if corrupt else [False]), "a file got its name while mapped"
    assert spare_inode not in mapped_inodes(), "the landing file is still mapped"
    assert spares_of(root.parent.parent, 0) == {}
    landed = root / LANDED
    if corrupt:
        assert not landed.exists(), "a file whose CRC32C is not the owner's got its name"
        return
    assert landed.stat().st_ino == spare_inode, "the file did not land in the mapped spare"
    assert landed.read_bytes() == bytes(memory_of(data))


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupt"])
def test_a_file_lands_through_its_spares_mapping_which_is_gone_before_the_name(
    shm: Path, corrupt: bool
) -> None:
    root = memory_root(shm, 0)
    root.mkdir(parents=True)
    run_ranks(receive_through_a_mapping, 2, shm, root, corrupt)


def test_a_landing_refused_after_a_mapped_spare_still_takes_the_whole_file(shm: Path) -> None:
    """The landing opens before the receives are posted into a mapping; when it is refused (a
    real EMFILE), the file is still received (into the buffers) and dropped: the sender's
    messages complete (its wait would raise otherwise), and the spare goes."""
    root = memory_root(shm, 0)
    root.mkdir(parents=True)
    run_ranks(fail_a_receive_after_taking_a_spare, 2, shm, root)


def _recycled(tier: MemoryTier, size: int, claimed: int) -> tuple[Spares, str]:
    spares = Spares(tier)
    tier.write_bytes("mirror/y/0/__0_0.distcp", b"\x5a" * size)
    spares.take(claimed)
    assert spares.recycle("mirror/y/0/__0_0.distcp", claimed)
    (spare,) = (spares.take(claimed),)
    assert spare is not None
    return spares, spare


def test_a_recycled_file_is_mapped_only_at_the_size_it_was_claimed_with(shm: Path) -> None:
    """A mapping longer than its file would fault (SIGBUS) past the file's end: a recycled file
    whose size is not the one its marker claimed lands by copy."""
    tier = MemoryTier("memory", str(shm / "a"))
    spares, spare = _recycled(tier, 2 * MIB, 2 * MIB)
    mapped = spares.mapping(spare)
    assert mapped is not None and len(mapped) == 2 * MIB
    mapped.close()
    tier = MemoryTier("memory", str(shm / "b"))
    spares, spare = _recycled(tier, 2 * MIB, 3 * MIB)
    assert spares.mapping(spare) is None
    assert os.stat(spare).st_ino not in mapped_inodes()


def test_a_recycled_file_is_mapped_after_the_round_that_recycles_it(shm: Path) -> None:
    """Retention recycles a mirror's files before the round's end: filling their page tables then
    (about 0.02 s per 256 MiB) would delay everyone waiting for the round. The refill after the
    round maps them; a round that takes one before (back to back) maps it as it takes it."""
    for back_to_back in (False, True):
        tier = MemoryTier("memory", str(shm / f"recycled-{back_to_back}"))
        spares = Spares(tier)
        tier.write_bytes("mirror/y/0/__0_0.distcp", b"\x5a" * MIB)
        inode = os.stat(tier.local_path("mirror/y/0/__0_0.distcp")).st_ino
        spares.take(MIB)
        assert spares.recycle("mirror/y/0/__0_0.distcp", MIB)
        assert inode not in mapped_inodes(), "the recycle mapped the file within the round"
        if not back_to_back:
            spares.refill()
            assert inode in mapped_inodes(), "the refill left the recycled spare unmapped"
        spare = spares.take(MIB)
        assert spare is not None and os.stat(spare).st_ino == inode
        mapped = spares.mapping(spare)
        assert mapped is not None and len(mapped) == MIB, "the spare was handed out unmapped"
        mapped.close()


def test_spares_off_a_tmpfs_are_not_mapped(disk_dir: Path) -> None:
    """Only a tmpfs's reserved pages can be written through a mapping without allocating (a disk
    filesystem may need blocks at the first write: a SIGBUS when it has none)."""
    spares = Spares(MemoryTier("memory", str(disk_dir)))
    spares.take(MIB)
    spares.refill()
    (spare,) = (spares.take(MIB),)
    assert spare is not None and spares.mapping(spare) is None
    assert os.stat(spare).st_ino not in mapped_inodes()


def test_a_forked_child_does_not_inherit_a_spares_mapping(shm: Path) -> None:
    """A training process forks (DataLoader workers): a child holding a spare's mapping would keep
    the file's pages after the spare is removed, room the node's own saves count on."""
    _tier, _spares, inode = one_mapped_spare(memory_root(shm, 0), MIB)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child only answers whether it has the mapping, and leaves
        os.write(write, b"1" if inode in mapped_inodes() else b"0")
        os._exit(0)
    os.close(write)
    inherited = os.read(read, 1)
    os.close(read)
    os.waitpid(child, 0)
    assert inherited == b"0", "the forked child holds the spare's mapping"
