"""Moving whole checkpoint files between ranks over a gloo group, without extra copies.

A sent file is memory-mapped read-only and handed to gloo chunk by chunk; a received file is
allocated up front in the receiving tier (``fallocate``: a full tmpfs is a clean ENOSPC naming the
tier, path and bytes, never a SIGBUS on a page fault later), mapped, and received straight into the
mapping. Each chunk travels under its own tag, so both sides only need to agree on a schedule. Every
received file is checked against its CRC32C before it gets its real name.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tierstore.checksum import crc32c
from tierstore.errors import IntegrityError, TierstoreError, TierUnavailableError
from tierstore.tiers import Tier
from tierstore.tiers.durable import fsync_dir, make_dirs_durable, temp_name_for

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
    size = tensor.numel()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


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
    works = []
    for index, start in enumerate(range(0, data.numel(), CHUNK)):
        work = dist.isend(data[start : start + CHUNK], dst=dst, group=group, tag=first_tag + index)
        assert work is not None
        works.append(work)
    return works


def post_recv(
    into: torch.Tensor, src: int, group: dist.ProcessGroup, first_tag: int
) -> list[dist.Work]:
    """Start receiving into ``into`` from global rank ``src`` (the mirror image of
    :func:`post_send`)."""
    works = []
    for index, start in enumerate(range(0, into.numel(), CHUNK)):
        work = dist.irecv(into[start : start + CHUNK], src=src, group=group, tag=first_tag + index)
        assert work is not None
        works.append(work)
    return works


def wait_all(works: list[dist.Work], timeout_s: float) -> None:
    """Wait for every message; raises when a peer fails or the timeout passes."""
    timeout = datetime.timedelta(seconds=max(1.0, timeout_s))
    for work in works:
        work.wait(timeout)


@dataclass
class IncomingFile:
    """A file being received into a tier: a hidden temp file, allocated and mapped."""

    tier: Tier
    path: str
    """Tier-relative final path."""
    size: int
    crc: int
    temp: Path
    buffer: torch.Tensor

    @classmethod
    def allocate(cls, tier: Tier, path: str, size: int, crc: int) -> IncomingFile:
        """Create and allocate the temp file; :class:`TierUnavailableError` when it cannot fit."""
        final = Path(local(tier, path))
        make_dirs_durable(final.parent)
        temp = temp_name_for(final, uuid.uuid4().hex[:12])
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            temp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierUnavailableError(
                    f"tier {tier.describe()}: no room for {path!r}: it needs {size} bytes"
                    f" ({free_bytes(final.parent)} free)",
                    tier=tier.name,
                ) from None
            raise
        os.close(fd)
        buffer = (
            torch.from_file(str(temp), shared=True, size=size, dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        return cls(tier, path, size, crc, temp, buffer)

    def publish(self) -> None:
        """Check the received bytes against the owner's CRC32C, then rename into place."""
        got = crc32c(bytes_of(self.buffer))
        if got != self.crc:
            raise IntegrityError(
                f"tier {self.tier.name}: {self.path}: received CRC32C {got:08x}, the owner's"
                f" marker says {self.crc:08x}"
            )
        self.buffer = torch.empty(0, dtype=torch.uint8)  # unmap before the rename
        fd = os.open(self.temp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a no-op on tmpfs; the recipe holds on any filesystem
        finally:
            os.close(fd)
        final = Path(local(self.tier, self.path))
        os.rename(self.temp, final)
        fsync_dir(final.parent)

    def discard(self) -> None:
        """Drop a file that will not be published."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.temp.unlink(missing_ok=True)


def free_bytes(directory: Path) -> int:
    """Bytes available to this process in the filesystem of ``directory``."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def check_room(tier: Tier, directory: str, needed: int) -> None:
    """:class:`TierUnavailableError` naming the tier, path and bytes when ``needed`` bytes (plus a
    margin) do not fit in ``directory``'s filesystem."""
    where = Path(local(tier, directory))
    make_dirs_durable(where)
    free = free_bytes(where)
    if needed and free < needed + SPACE_MARGIN:
        raise TierUnavailableError(
            f"tier {tier.describe()}: {where}: a peer mirror needs {needed} bytes"
            f" (+{SPACE_MARGIN} spare), {free} free; size host memory for own checkpoints,"
            " a partner's mirror and staging (docs/mirror.md)",
            tier=tier.name,
        )
