"""Where the peer mirror's exchange spends its time beyond gloo's own send/receive.

    python benchmarks/mirror_paths.py [--size 256MiB] [--rounds 8]

Two processes on this host, gloo on loopback, ``--size`` bytes each way per round (both directions
at once, as a mirror round of two nodes moves them), 16 MiB messages. Every round runs each way
below once, in an order rotated from round to round; the figures are medians of per-round ratios
of bandwidth against plain gloo (higher is faster; 1.0 is gloo's own speed):

* ``plain gloo``: warm memory to warm memory, nothing else (the target's baseline);
* ``sender maps the file``: the sender hands gloo a fresh mapping of a tmpfs file
  (``Tier.map_file``, as the mirror does), the receiver takes the bytes into warm memory;
* ``tierstore transfer``: the mirror's own code, :func:`~tierstore.dcp.mirror.transport.post_send`
  of a mapped tier file and :func:`~tierstore.dcp.mirror.transport.receive_file` into a recycled
  landing file (CRC32C, write, fsync, rename), as in steady state;
* ``receive into a kept mapping``: warm sender; the receiver hands gloo a writable mapping of a
  reserved tmpfs file that stays mapped from round to round and sums each message (CRC32C) as it
  lands: the design docs/performance.md weighs ("Peer mirror against gloo");
* ``both``: the sender's mapped file into the receiver's kept mapping (the two together).

Prints the medians (seconds and process CPU of both ranks) and the ratios; writes nothing else.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierstore.checksum import crc32c
from tierstore.config import config_from_dict
from tierstore.dcp.mirror.spares import Spares
from tierstore.dcp.mirror.transport import CHUNK, map_file, receive_file, send_files
from tierstore.records.marker import FileEntry
from tierstore.tiers import make_tier
from tierstore.units import parse_size

TIMEOUT_S = 120.0
WAYS = (
    "plain gloo",
    "sender maps the file",
    "tierstore transfer",
    "receive into a kept mapping",
    "both: mapped file into a kept mapping",
)


def rank_main(rank: int, size: int, rounds: int, root: str, store: str) -> None:
    """One of the two processes: set up, run every way each round, print rank 0's figures."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    peer = 1 - rank
    tier = make_tier(
        config_from_dict(
            {"tiers": [{"name": "ram", "type": "memory", "path": f"{root}/{rank}"}]}, check_paths=False
        ).tiers[0],
        namespace="probe",
        node=rank,
    )
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tier.write_bytes("own/data.bin", memoryview(source.numpy()))
    entry_of_peer = FileEntry("data.bin", size, crc32c_of_peer(source))
    warm = torch.ones(size, dtype=torch.uint8)
    spares = Spares(tier)
    kept = KeptMapping(f"{root}/{rank}-kept.bin", size)

    def send(data: torch.Tensor) -> None:
        send_files([(data, peer, 0)], dist.group.WORLD, timeout_s=TIMEOUT_S)

    def plain() -> None:
        both(lambda: send(source), lambda: receive_into(warm, peer, crc=False))

    def sender_maps() -> None:
        both(lambda: send(map_file(tier, "own/data.bin", size)), lambda: receive_into(warm, peer, crc=False))

    def tierstore_transfer() -> None:
        both(
            lambda: send(map_file(tier, "own/data.bin", size)),
            lambda: receive_file(
                tier,
                "peer/data.bin",
                entry_of_peer,
                peer,
                dist.group.WORLD,
                first_tag=0,
                timeout_s=TIMEOUT_S,
                spares=spares,
            ),
        )
        # steady state: the landed file goes back as the next round's spare (retention's recycle)
        assert spares.recycle("peer/data.bin", size)

    def kept_mapping() -> None:
        both(lambda: send(source), lambda: receive_into(kept.tensor, peer, crc=True))

    def mapped_both_sides() -> None:
        both(
            lambda: send(map_file(tier, "own/data.bin", size)),
            lambda: receive_into(kept.tensor, peer, crc=True),
        )

    ways: dict[str, Callable[[], None]] = dict(
        zip(WAYS, (plain, sender_maps, tierstore_transfer, kept_mapping, mapped_both_sides), strict=True)
    )
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}
    for index in range(rounds + 1):  # round 0 warms everything up: not counted
        shift = index % len(WAYS)
        for way in WAYS[shift:] + WAYS[:shift]:
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            ways[way]()
            dist.barrier()
            spent = [time.perf_counter() - started, time.process_time() - cpu_started]
            both_ranks: list[list[float] | None] = [None, None]
            dist.all_gather_object(both_ranks, spent)
            if index:
                seconds[way].append(max(s[0] for s in both_ranks if s))
                cpu[way].append(sum(s[1] for s in both_ranks if s))
    if rank == 0:
        report(seconds, cpu, size)
    kept.close()
    dist.destroy_process_group()


def crc32c_of_peer(source: torch.Tensor) -> int:
    """The CRC32C of the peer's file (both ranks build the same bytes from the same seed)."""
    return crc32c(memoryview(source.numpy()))


def both(send: Callable[[], None], receive: Callable[[], None]) -> None:
    """Send on a thread of its own while this thread receives (as the mirror's exchange does)."""
    failure: list[BaseException] = []

    def sending() -> None:
        try:
            send()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            failure.append(exc)

    thread = threading.Thread(target=sending)
    thread.start()
    receive()
    thread.join()
    if failure:
        raise failure[0]


def receive_into(into: torch.Tensor, src: int, *, crc: bool) -> None:
    """Receive ``into`` in :data:`CHUNK` messages, all posted at once; sum each as it lands."""
    works = [
        (start, dist.irecv(into[start : start + CHUNK], src=src, tag=index))
        for index, start in enumerate(range(0, into.numel(), CHUNK))
    ]
    value = 0
    for start, work in works:
        assert work is not None
        work.wait()
        if crc:
            value = crc32c(memoryview(into[start : start + CHUNK].numpy()), value)


class KeptMapping:
    """A reserved tmpfs file mapped writable once and kept mapped (its page tables stay warm)."""

    def __init__(self, path: str, size: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(self.fd, 0, size)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensor.fill_(0)  # every page touched once, as a file received before would be
        self.path = path

    def close(self) -> None:
        del self.tensor
        self.map.close()
        os.close(self.fd)
        os.unlink(self.path)


def report(seconds: dict[str, list[float]], cpu: dict[str, list[float]], size: int) -> None:
    """Print medians and per-round bandwidth ratios against plain gloo."""
    base = seconds["plain gloo"]
    print(f"{2 * size / 2**20:.0f} MiB a round (both directions), {len(base)} rounds")
    print(f"{'way':<30} {'median s':>9} {'CPU s':>7} {'vs plain gloo':>14}")
    for way in WAYS:
        ratio = statistics.median(b / s for b, s in zip(base, seconds[way], strict=True))
        print(
            f"{way:<30} {statistics.median(seconds[way]):9.3f} "
            f"{statistics.median(cpu[way]):7.3f} {ratio:14.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB", help="bytes each way per round")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="tierstore-paths-") as root:
        store = f"{root}/store"
        mp.spawn(rank_main, args=(size, args.rounds, root, store), nprocs=2)


if __name__ == "__main__":
    main()
