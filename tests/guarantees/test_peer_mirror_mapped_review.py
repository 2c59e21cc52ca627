"""Review of the mapped receive (``tierstore/dcp/mirror/spares.py``, ``transport.py``) with real
faults: a peer that dies mid-file, a peer that sends after the receiver gave up, and the sizes at
the chunk boundaries, several files in one round each landing in a spare of its own."""

from __future__ import annotations

import datetime
import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.guarantees.test_peer_mirror_mapped import mapped_inodes, one_mapped_spare
from tests.guarantees.test_peer_mirror_spares import spares_of
from tests.mirror_jobs import memory_root
from tests.workers import run_ranks
from tierstore.checksum import crc32c
from tierstore.dcp.layout import memory_of
from tierstore.dcp.mirror.spares import Spares
from tierstore.dcp.mirror.transport import CHUNK, post_send, receive_file, wait_all
from tierstore.records.marker import FileEntry
from tierstore.tiers.memory import MemoryTier

SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7]


def data_of(size: int, seed: int) -> torch.Tensor:
    return ((torch.arange(size, dtype=torch.int64) * 31 + seed) % 253).to(torch.uint8)


def entry_of(index: int, data: torch.Tensor) -> FileEntry:
    return FileEntry(f"0/__1_{index}.distcp", data.numel(), crc32c(memory_of(data)), rank=1, node=1)


def tag_of(index: int) -> int:
    return 1 + index * 100


def two_rounds_of_edge_sizes(rank: int, world: int, root: Path) -> None:
    """Rank 1 sends one file of each of :data:`SIZES` in a round, twice (other bytes the second
    time); rank 0 receives each round into spares reserved and mapped before it."""
    for round_ in (1, 2):
        datas = [data_of(size, round_ * 7 + i) for i, size in enumerate(SIZES)]
        if rank == 1:
            works = [w for i, d in enumerate(datas) for w in post_send(d, 0, dist.group.WORLD, tag_of(i))]
            wait_all(works, 60)
            dist.barrier()
            continue
        if round_ == 1:
            tier = MemoryTier("memory", str(root))
            spares = Spares(tier)
            for size in SIZES:
                spares.take(size)
            spares.refill()
        spare_inodes = set(spares_of(root.parent.parent, 0))
        nonempty = [s for s in SIZES if s]
        assert len(spare_inodes) == len(nonempty)
        assert spare_inodes <= mapped_inodes(), "every spare of a tmpfs is mapped"
        landed = []
        for i, data in enumerate(datas):
            path = f"mirror/r{round_}/0/__1_{i}.distcp"
            receive_file(
                tier,
                path,
                entry_of(i, data),
                1,
                dist.group.WORLD,
                first_tag=tag_of(i),
                timeout_s=60,
                spares=spares,
            )
            landed.append(root / path)
        inodes = [p.stat().st_ino for p in landed]
        assert len(set(inodes)) == len(inodes), "two files landed in one inode"
        assert {i for p, i in zip(landed, inodes, strict=True) if p.stat().st_size} == spare_inodes
        for path, data in zip(landed, datas, strict=True):
            assert path.read_bytes() == bytes(memory_of(data)), path
        assert not set(inodes) & mapped_inodes(), "a committed file is mapped"
        spares.refill()  # the same sizes again: fresh spares, mapped, never the landed inodes
        assert not set(spares_of(root.parent.parent, 0)) & set(inodes)
        dist.barrier()


def test_every_size_at_a_chunk_boundary_lands_byte_exact_in_a_spare_of_its_own(shm: Path) -> None:
    root = memory_root(shm, 0)
    root.mkdir(parents=True)
    run_ranks(two_rounds_of_edge_sizes, 2, shm, root)


FAILING = 3 * CHUNK


def fail_mid_file(rank: int, world: int, root: Path, how: str) -> None:
    """Rank 1 sends the first chunk of a 3-chunk file, then dies (``dies``) or sends the rest only
    after rank 0 gave up waiting (``late``). Rank 0 receives into a mapped spare; its findings go
    to ``root/result.json`` (it leaves with ``os._exit``: the group is broken)."""
    data = data_of(FAILING, 3)
    entry = entry_of(0, data)
    flag = root / "gave-up"
    if rank == 1 and how == "pause":  # everything, once the receiver gave up
        while not flag.exists():
            time.sleep(0.05)
        sent = ""
        try:
            wait_all(post_send(data, 0, dist.group.WORLD, tag_of(0)), 5)
        except RuntimeError as exc:
            sent = str(exc)[:200]
        (root / "sent.txt").write_text(sent)
        time.sleep(2)
        os._exit(0)
    if rank == 1:
        first = dist.isend(data[:CHUNK], dst=0, group=dist.group.WORLD, tag=tag_of(0))
        assert first is not None
        first.wait()
        if how == "dies":
            time.sleep(0.5)  # the receiver is waiting for the second chunk
            os._exit(0)
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in (1, 2):  # the receiver's timeout may have closed the pair: then nothing goes
            try:
                work = dist.isend(
                    data[CHUNK * i : CHUNK * (i + 1)], dst=0, group=dist.group.WORLD, tag=tag_of(0) + i
                )
                assert work is not None
                work.wait(datetime.timedelta(seconds=5))
            except RuntimeError:
                break
        time.sleep(2)
        os._exit(0)
    tier, spares, spare_inode = one_mapped_spare(root, FAILING)
    failed = ""

    def stop() -> None:
        raise RuntimeError("stop")

    # "pause": the drain waits for a sender that sends only once this gave up, so it runs to the
    # timeout (5 s: the drain's wait is what is timed out, the mapping's release what is checked)
    try:
        receive_file(
            tier,
            "mirror/x/0/__1_0.distcp",
            entry,
            1,
            dist.group.WORLD,
            first_tag=tag_of(0),
            timeout_s={"late": 1, "pause": 5}.get(how, 60),
            spares=spares,
            pause=stop if how == "pause" else lambda: None,
        )
    except Exception as exc:  # noqa: BLE001 - the finding is the type
        failed = type(exc).__name__
    gc.collect()
    result = {
        "failed": failed,
        "named": (root / "mirror/x/0/__1_0.distcp").exists(),
        "spares": len(spares_of(root.parent.parent, 0)),
        "mapped_after": spare_inode in mapped_inodes(),
    }
    flag.touch()
    time.sleep(4)  # the late bytes arrive now, if gloo still has somewhere to put them
    torch.zeros(64 * 2**20, dtype=torch.uint8).add_(1)  # memory churn: a stale pointer shows
    result["mapped_later"] = spare_inode in mapped_inodes()
    result["pid"] = os.getpid()
    (root / "result.json").write_text(json.dumps(result))
    os._exit(0)


@pytest.mark.parametrize("how", ["dies", "late", "pause"])
def test_a_receive_into_a_mapping_that_fails_mid_file_leaves_nothing_mapped_or_named(
    shm: Path, how: str
) -> None:
    """A peer that dies after the first chunk, or whose rest arrives after the receiver's timeout:
    the receiver survives (no SIGSEGV/SIGBUS), no file has the name, the spare is gone, and no
    mapping keeps its pages once the error is handled."""
    root = memory_root(shm, 0)
    root.mkdir(parents=True)
    run_ranks(fail_mid_file, 2, shm, root, how)
    result = json.loads((root / "result.json").read_text())
    assert result["failed"], result
    assert not result["named"], result
    assert result["spares"] == 0, result
    assert not result["mapped_after"], result
    assert not result["mapped_later"], result


def descriptors_of(inode: int) -> list[int]:
    """This process's descriptors open on the file ``inode`` (``/proc/self/fd``)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.fstat(int(name)).st_ino == inode:
                found.append(int(name))
        except OSError:
            continue
    return found


def test_a_forked_child_holds_no_descriptor_of_a_mapped_spare(shm: Path) -> None:
    """The mapping is not inherited (MADV_DONTFORK), and neither may a descriptor of the spare be:
    a DataLoader worker forked between rounds that holds one keeps the file's pages after this
    process removes the spare, as long as the worker lives (a mapping's descriptor kept open by
    :class:`mmap.mmap` would be inherited: only ``exec`` closes it)."""
    _tier, spares, inode = one_mapped_spare(memory_root(shm, 0), 2**20)
    child = os.fork()
    if child == 0:  # the child only answers (its exit status) whether it holds the file
        os._exit(1 if descriptors_of(inode) else 0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child holds a descriptor of the spare"
    spares.release_unused([])
    assert inode not in mapped_inodes() and not descriptors_of(inode)


def pause_fails_while_sending(rank: int, world: int, root: Path) -> None:
    """Rank 1 sends a 3-chunk file; rank 0's ``pause()`` raises every time it is called, after
    its receives were posted into the spare's mapping. The sender's wait must complete: the
    receiver drains the file though its pause failed, or the group is broken for the next save."""
    data = data_of(FAILING, 5)
    if rank == 1:
        wait_all(post_send(data, 0, dist.group.WORLD, tag_of(0)), 30)
        return
    tier, spares, spare_inode = one_mapped_spare(root, FAILING)

    def stop() -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        receive_file(
            tier,
            "mirror/x/0/__1_0.distcp",
            entry_of(0, data),
            1,
            dist.group.WORLD,
            first_tag=tag_of(0),
            timeout_s=30,
            spares=spares,
            pause=stop,
        )
    gc.collect()
    assert not (root / "mirror/x/0/__1_0.distcp").exists()
    assert spares_of(root.parent.parent, 0) == {}
    assert spare_inode not in mapped_inodes()


def test_a_receive_whose_pause_fails_still_drains_the_senders_messages(shm: Path) -> None:
    root = memory_root(shm, 0)
    root.mkdir(parents=True)
    run_ranks(pause_fails_while_sending, 2, shm, root)
