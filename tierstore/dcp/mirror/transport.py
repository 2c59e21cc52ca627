"""Moving whole checkpoint files between ranks over a gloo group.

A sent file is memory-mapped and handed to gloo chunk by chunk (no copy), each chunk's page tables
filled in one call as it is posted. A received file arrives chunk by chunk, straight into its landing
file's mapping where the spare it lands in is mapped (a tmpfs), else in a few rotating buffers kept
warm from round to round and written into a file whose pages were reserved before (a spare made
between rounds, or reserved at once), so a receiver's memory stays bounded and a full tmpfs is a
clean ENOSPC naming the tier and path, never a SIGBUS.
Each chunk travels under its own tag, so both sides only need to agree on a schedule. Every received
file is checked against its CRC32C before it gets its real name.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from tierstore._platform.mapping import Mapping, populate_for_reading
from tierstore.checksum import crc32c
from tierstore.dcp.layout import memory_of
from tierstore.dcp.mirror.spares import Spares, files_of
from tierstore.errors import IntegrityError, TierUnavailableError
from tierstore.records.marker import FileEntry
from tierstore.tiers import Landing, Tier

CHUNK = 16 * 2**20
"""Bytes per gloo message: as fast on loopback as larger ones, and small enough that a
receiver sums and writes one while the next ones travel."""
SPACE_MARGIN = 16 * 2**20
"""Free space a receiver leaves in its tier beyond the files it takes (other writers need some)."""


def chunks(size: int) -> int:
    """The number of messages a file of ``size`` bytes travels in (0 for an empty file)."""
    return -(-size // CHUNK)


def map_file(tier: Tier, path: str, size: int) -> torch.Tensor:
    """The first ``size`` bytes of the file ``path`` of ``tier`` as a uint8 tensor, mapped
    (:meth:`~tierstore.tiers.LocalFace.map_file`: nothing is copied, and nothing written to the tensor
    reaches the file). :class:`~tierstore.errors.IntegrityError` if the file is shorter."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    view = files_of(tier).map_file(path)
    if len(view) < size:
        raise IntegrityError(f"tier {tier.name}: {path}: {len(view)} bytes, the marker says {size}")
    return torch.frombuffer(view, dtype=torch.uint8, count=size)  # the tensor keeps the mapping


def post_send(data: torch.Tensor, dst: int, group: dist.ProcessGroup, first_tag: int) -> list[dist.Work]:
    """Start sending ``data`` to global rank ``dst``, one message per chunk, tags from
    ``first_tag``."""
    return [
        _posted(dist.isend(data[start : start + CHUNK], dst=dst, group=group, tag=first_tag + i))
        for i, start in enumerate(range(0, data.numel(), CHUNK))
    ]


SEND_AHEAD = 4
"""Messages a sender keeps in flight (:func:`send_files`): one more than a receiver posts ahead."""


def send_files(
    sends: list[tuple[torch.Tensor, int, int]],
    group: dist.ProcessGroup,
    *,
    timeout_s: float,
    pause: Callable[[], object] = lambda: None,
) -> None:
    """Send each ``(data, dst, first_tag)`` as :func:`post_send` would, in order, at most
    :data:`SEND_AHEAD` messages in flight, calling ``pause()`` before posting each one.

    gloo moves a message only once its receiver has posted the receive, so a sender that stops
    posting stops sending (after the messages in flight), and a receiver that pauses holds its
    senders back in turn. Raises when a message fails or waits past ``timeout_s`` (then the rest
    is not sent: the group is broken for this round anyway)."""
    in_flight: collections.deque[dist.Work] = collections.deque()
    for data, dst, first_tag in sends:
        for index, start in enumerate(range(0, data.numel(), CHUNK)):
            if len(in_flight) >= SEND_AHEAD:
                wait_all([in_flight.popleft()], timeout_s)
            pause()
            piece = data[start : start + CHUNK]
            # A mapped file's pages, mapped in one call while the messages before travel: gloo's
            # thread would otherwise fault them in one by one as it sends.
            populate_for_reading(piece.data_ptr(), piece.numel())
            in_flight.append(_posted(dist.isend(piece, dst=dst, group=group, tag=first_tag + index)))
    wait_all(list(in_flight), timeout_s)


def post_recv(into: torch.Tensor, src: int, group: dist.ProcessGroup, first_tag: int) -> list[dist.Work]:
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
    spares: Spares | None = None,
    pause: Callable[[], object] = lambda: None,
) -> None:
    """Receive a file sent by :func:`post_send` into ``path`` of ``tier``, durably, checked.

    Chunks arrive in rotating buffers kept warm from file to file (``spares``' own, else fresh
    ones), :data:`AHEAD` receives always posted, so the next chunks travel while one is summed
    (CRC32C) and written. The file's pages are reserved before the first chunk
    (:meth:`~tierstore.tiers.LocalFace.open_landing`; a spare of its size reserved between rounds
    saves even that): a full tier is a clean ENOSPC (:class:`~tierstore.errors.TierUnavailableError`)
    naming the tier and path. A spare that ``spares`` mapped (a tmpfs) is received into
    directly: gloo writes the bytes into the file's pages and only their CRC32C is taken here, and
    the mapping is closed before the file gets its name. Only a file whose CRC32C is the owner's
    gets its name (fsync, rename,
    fsync the directory). When the file cannot be taken, the rest of it is still received (and
    dropped): the sender's messages all complete, so the group stays usable for the next save.
    ``pause()`` is called before each chunk is taken (see :func:`send_files`).
    """
    spare = None if spares is None else spares.take(entry.size)
    mapped = _Mapped(None if spare is None or spares is None else spares.mapping(spare))
    incoming: _Chunks | None = None
    landing: Landing | None = None
    try:
        if mapped.tensor is not None:  # open first: the landing must not change the mapped file
            try:
                landing = _open_landing(tier, path, entry.size, spare)
            except TierUnavailableError:
                mapped.close(unmap=True)  # nothing was posted into it
                # the file still arrives, into the buffers, and is dropped (drain, below)
                incoming = _Chunks(entry.size, src, group, first_tag, timeout_s, _buffers(spares), pause)
                raise
        incoming = _Chunks(
            entry.size, src, group, first_tag, timeout_s, _buffers(spares), pause, mapped.tensor
        )
        if landing is None:  # posted first: the first chunks travel while pages are reserved
            landing = _open_landing(tier, path, entry.size, spare)
        value = 0
        for offset, view in incoming:
            if mapped.tensor is not None:  # gloo wrote the bytes into the file's pages
                value = crc32c(view, value)
                continue
            for start in range(0, len(view), SLICE):  # summed, then written while in the cache
                piece = view[start : start + SLICE]
                value = crc32c(piece, value)
                landing.write_at(offset + start, piece)
        if value != entry.crc32c:
            raise IntegrityError(
                f"tier {tier.name}: {path}: received CRC32C {value:08x}, the owner's marker"
                f" says {entry.crc32c:08x}"
            )
        incoming.mapped = None
        mapped.close(unmap=True)  # every receive done; before the name: no committed file mapped
        files_of(tier).adopt(path, landing.seal())
    finally:
        if incoming is not None:
            incoming.drain()
            incoming.mapped = None
        # A receive may still be in flight into the mapping when the file's receipt failed
        # (posted, never waited for): then the mapping goes with the last reference to it
        # (gloo's), never from under a receive.
        mapped.close(unmap=incoming is not None and not incoming.posted)
        if landing is not None:
            landing.discard()  # removes the spare too, when it was the landing
        elif spare is not None and spares is not None:
            spares.discard(spare)  # taken, never a landing: nobody else would remove it


def _open_landing(tier: Tier, path: str, size: int, spare: str | None) -> Landing:
    try:
        return files_of(tier).open_landing(path, size, spare)
    except OSError as exc:
        raise TierUnavailableError(
            f"tier {tier.describe()}: cannot take the peer mirror {path!r}"
            f" ({size} bytes): {exc.strerror or exc}; size host memory for own"
            " checkpoints, a partner's mirror and staging (docs/mirror.md)",
            tier=tier.name,
        ) from exc


class _Mapped:
    """A spare's writable mapping (:meth:`Spares.mapping`) as a uint8 tensor, until closed."""

    def __init__(self, mapping: Mapping | None) -> None:
        self.mapping = mapping
        self.tensor = None if mapping is None else torch.frombuffer(mapping, dtype=torch.uint8)

    def close(self, *, unmap: bool) -> None:
        """Let go of the mapping; ``unmap``: unmap it now, which only a caller sure that no
        receive into it is in flight may ask (a tensor does not hold its buffer exported: the
        memory would go from under gloo). Otherwise it is unmapped with the last reference to
        it, the tensors of receives still posted."""
        self.tensor = None
        if self.mapping is not None and unmap:
            self.mapping.close()
        self.mapping = None


AHEAD = 3
SLICE = 2**20
"""Bytes summed and written at a time: the write reads them from the cache, not from memory."""
"""Receives a receiver keeps posted ahead (each into a buffer of its own, :data:`CHUNK` bytes)."""


def _buffers(spares: Spares | None) -> list[torch.Tensor]:
    if spares is not None:
        return spares.buffers(AHEAD, CHUNK)
    return [torch.empty(CHUNK, dtype=torch.uint8) for _ in range(AHEAD)]


class _Chunks:
    """The chunks of one incoming file, in order, :data:`AHEAD` receives always posted."""

    def __init__(  # noqa: PLR0917 - one file's receive, as receive_file was given it
        self,
        size: int,
        src: int,
        group: dist.ProcessGroup,
        first_tag: int,
        timeout_s: float,
        buffers: list[torch.Tensor],
        pause: Callable[[], object],
        mapped: torch.Tensor | None = None,
    ) -> None:
        self.size, self.src, self.group, self.first_tag = size, src, group, first_tag
        self.timeout_s, self.buffers, self.pause = timeout_s, buffers, pause
        self.mapped = mapped
        """The landing file's mapping: chunks are received straight into it (None: buffers)."""
        self.posted: collections.deque[tuple[int, dist.Work, torch.Tensor]] = collections.deque()
        self.next = 0
        """The index of the next chunk to post."""
        self.broken = False
        for _ in buffers:
            self._post()

    def _post(self) -> None:
        index = self.next
        start = index * CHUNK
        if start >= self.size:
            return
        length = min(CHUNK, self.size - start)
        into = (
            self.buffers[index % len(self.buffers)][:length]
            if self.mapped is None
            else self.mapped[start : start + length]
        )
        work = dist.irecv(into, src=self.src, group=self.group, tag=self.first_tag + index)
        assert work is not None
        self.posted.append((index, work, into))
        self.next += 1

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        while self.posted:
            self.pause()  # before the CPU's share of a chunk: its sum and its write
            index, work, into = self.posted[0]
            try:
                wait_all([work], self.timeout_s)
            except Exception:
                self.broken = True  # the peer or the group failed: nothing left to drain
                raise
            yield index * CHUNK, memory_of(into)
            self.posted.popleft()  # its buffer is free only now: the caller is done with it
            self._post()

    def drain(self) -> None:
        """Receive and drop whatever of the file has not been taken yet."""
        if self.broken:
            return
        pause = self.pause

        def pause_quietly() -> None:  # a pause that fails (as the receipt may have) must not
            with contextlib.suppress(Exception):  # leave the sender's messages unreceived
                pause()

        self.pause = pause_quietly
        with contextlib.suppress(Exception):  # a peer that failed meanwhile: nothing to save
            for _item in self:
                pass


def check_room(tier: Tier, directory: str, needed: int) -> None:
    """:class:`TierUnavailableError` naming the tier, path and bytes when ``needed`` bytes (plus a
    margin) do not fit in the tier's filesystem (``directory`` is where they would go)."""
    if not needed:
        return
    free = files_of(tier).space().free
    if free < needed + SPACE_MARGIN:
        raise TierUnavailableError(
            f"tier {tier.describe()}: {directory}: a peer mirror needs {needed} bytes"
            f" (+{SPACE_MARGIN} spare), {free} free; size host memory for own checkpoints,"
            " a partner's mirror and staging (docs/mirror.md)",
            tier=tier.name,
        )
