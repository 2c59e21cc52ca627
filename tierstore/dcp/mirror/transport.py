"""Moving whole checkpoint files between ranks over a gloo group.

A sent file is memory-mapped and handed to gloo chunk by chunk (no copy). A received file arrives
chunk by chunk in two rotating buffers and goes through the tier's durable write, so a receiver's
memory stays bounded and a full tmpfs is a clean ENOSPC naming the tier and path, never a SIGBUS.
Each chunk travels under its own tag, so both sides only need to agree on a schedule. Every received
file is checked against its CRC32C before it gets its real name.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from tierstore.checksum import crc32c
from tierstore.dcp.layout import memory_of
from tierstore.errors import IntegrityError, TierstoreError, TierUnavailableError
from tierstore.records.marker import FileEntry
from tierstore.tiers import Tier

CHUNK = 64 * 2**20
"""Bytes per gloo message: large enough for full loopback speed, small enough to pipeline."""
SPACE_MARGIN = 16 * 2**20
"""Free space a receiver leaves in its tier beyond the files it takes (other writers need some)."""


def local(tier: Tier, path: str) -> str:
    """The real path of ``path`` in a tier with local files (memory tiers always have them)."""
    found = tier.local_path(path)
    if found is None:
        raise TierstoreError(f"tier {tier.describe()} has no local files to mirror")
    return found


def chunks(size: int) -> int:
    """The number of messages a file of ``size`` bytes travels in (0 for an empty file)."""
    return -(-size // CHUNK)


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without a copy."""
    return memory_of(tensor)


def map_file(path: str, size: int) -> torch.Tensor:
    """A read-only-in-spirit mapping of a stored file as a uint8 tensor (nothing is copied)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def post_send(
    data: torch.Tensor, dst: int, group: dist.ProcessGroup, first_tag: int
) -> list[dist.Work]:
    """Start sending ``data`` to global rank ``dst``, one message per chunk, tags from
    ``first_tag``."""
    return [
        _posted(dist.isend(data[start : start + CHUNK], dst=dst, group=group, tag=first_tag + i))
        for i, start in enumerate(range(0, data.numel(), CHUNK))
    ]


def post_recv(
    into: torch.Tensor, src: int, group: dist.ProcessGroup, first_tag: int
) -> list[dist.Work]:
    """Start receiving into ``into`` from global rank ``src`` (the mirror image of
    :func:`post_send`)."""
    return [
        _posted(dist.irecv(into[start : start + CHUNK], src=src, group=group, tag=first_tag + i))
        for i, start in enumerate(range(0, into.numel(), CHUNK))
    ]


def _posted(work: dist.Work | None) -> dist.Work:
    assert work is not None, "this rank is not in the group"
    return work


def wait_all(works: list[dist.Work], timeout_s: float) -> None:
    """Wait for every message; raises when a peer fails or the timeout passes."""
    timeout = datetime.timedelta(seconds=max(1.0, timeout_s))
    for work in works:
        work.wait(timeout)


def receive_file(
    tier: Tier,
    path: str,
    entry: FileEntry,
    src: int,
    group: dist.ProcessGroup,
    *,
    first_tag: int,
    timeout_s: float,
) -> None:
    """Receive a file sent by :func:`post_send` into ``path`` of ``tier``, durably, checked.

    Chunks arrive in two rotating buffers and are written through the tier's own durable write
    (temp file, fsync, rename), so memory stays bounded, a full tier is a clean ENOSPC
    (:class:`~tierstore.errors.TierUnavailableError`), and a file whose CRC32C differs from the
    owner's marker never gets its name. When writing fails, the rest of the file is still received
    (and dropped): the sender's messages all complete, so the group stays usable for the next save.
    """
    incoming = _Chunks(entry.size, src, group, first_tag, timeout_s)
    try:
        value = 0
        with tier.open_write(path) as stream:
            for view in incoming:
                value = crc32c(view, value)
                stream.write(view)
            if value != entry.crc32c:
                raise IntegrityError(
                    f"tier {tier.name}: {path}: received CRC32C {value:08x}, the owner's marker"
                    f" says {entry.crc32c:08x}"
                )
    finally:
        incoming.drain()


class _Chunks:
    """The chunks of one incoming file, in order, one receive always posted ahead."""

    def __init__(
        self, size: int, src: int, group: dist.ProcessGroup, first_tag: int, timeout_s: float
    ) -> None:
        self.size, self.src, self.group, self.first_tag = size, src, group, first_tag
        self.timeout_s = timeout_s
        count = chunks(size)
        self.buffers = [
            torch.empty(min(CHUNK, size), dtype=torch.uint8) for _ in range(min(2, count))
        ]
        self.next = 0
        """The index of the next chunk to wait for."""
        self.pending = self._post(0)
        self.broken = False

    def _post(self, index: int) -> dist.Work | None:
        start = index * CHUNK
        if start >= self.size:
            return None
        into = self.buffers[index % 2][: min(CHUNK, self.size - start)]
        work = dist.irecv(into, src=self.src, group=self.group, tag=self.first_tag + index)
        assert work is not None
        return work

    def __iter__(self) -> Iterator[memoryview]:
        while self.pending is not None:
            index = self.next
            try:
                wait_all([self.pending], self.timeout_s)
            except Exception:
                self.broken = True  # the peer or the group failed: nothing left to drain
                raise
            self.next += 1
            self.pending = self._post(self.next)
            yield bytes_of(self.buffers[index % 2][: min(CHUNK, self.size - index * CHUNK)])

    def drain(self) -> None:
        """Receive and drop whatever of the file has not been taken yet."""
        if self.broken:
            return
        with contextlib.suppress(Exception):  # a peer that failed meanwhile: nothing to save
            for _view in self:
                pass


def free_bytes(directory: Path) -> int:
    """Bytes available to this process in the filesystem of ``directory``."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def check_room(tier: Tier, directory: str, needed: int) -> None:
    """:class:`TierUnavailableError` naming the tier, path and bytes when ``needed`` bytes (plus a
    margin) do not fit in the tier's filesystem (``directory`` is where they would go)."""
    where = Path(local(tier, directory))
    free = free_bytes(Path(local(tier, "")))
    if needed and free < needed + SPACE_MARGIN:
        raise TierUnavailableError(
            f"tier {tier.describe()}: {where}: a peer mirror needs {needed} bytes"
            f" (+{SPACE_MARGIN} spare), {free} free; size host memory for own checkpoints,"
            " a partner's mirror and staging (docs/mirror.md)",
            tier=tier.name,
        )
