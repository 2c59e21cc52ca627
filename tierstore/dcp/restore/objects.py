"""A restore's items from one object in an object store: large ranged GETs, or item by item.

When the items need more than half the object, it is fetched in parallel ranged GETs streamed
straight into the destinations: a tensor whose destination is exactly its stored bytes (raw
encoding, the whole stored chunk, a contiguous CPU tensor of the stored dtype) is read into its own
memory, with no buffer of the object's size and no second pass copying out of it (measured on a
1 GiB object, that buffer and copy were a tenth of an S3 restore, and they doubled its peak memory);
every other item (byte items, ``torch`` encoded or sliced tensors) gets a buffer of its own, decoded
afterwards. Adjacent items (64-byte padding between them is read into scratch) form runs, cut into
pieces of at most ``chunk`` bytes, each one GET whose body is streamed into its destinations in
order; a gap no item needs, larger than :data:`SKIP_GAP`, is not fetched. S3 sends no checksum for
a range: every item is checked against its CRC32C before use, and read again once on a mismatch.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from tierstore.dcp.layout import ItemLocation, memory_of
from tierstore.dcp.restore.items import (
    ATTEMPTS,
    Request,
    deliver,
    in_place_target,
    is_intact,
    read_item,
    read_items,
)
from tierstore.dcp.restore.session import RestoreSession, logger
from tierstore.ids import checkpoint_file

_WHOLE_FILE_FRACTION = 0.5
"""Read an object in large GETs when the items need more than this share of it, else item by item."""

SKIP_GAP = 2**20
"""Bytes between two needed items above which the GET is split instead of reading them."""


@dataclass
class Piece:
    """One ranged GET: ``offset`` in the object and the destinations its body fills, in order."""

    offset: int
    outs: list[memoryview] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Bytes the GET asks for."""
        return sum(len(out) for out in self.outs)


def read_object(
    session: RestoreSession, path: str, requests: list[Request], planner: LoadPlanner, size: int | None
) -> None:
    """Read, check and deliver ``requests``, all stored in the copy's file ``path`` (``size``
    bytes as the marker records, or None to ask the tier)."""
    tier, full = session.tier, checkpoint_file(session.checkpoint_id, path)
    assert tier is not None
    needed = sum(location.length for _, location in requests)
    size = tier.stat(full).size if size is None else size
    if needed <= _WHOLE_FILE_FRACTION * size:
        read_items(session, requests, planner)
        return
    # Items over the same stored bytes (one chunk resharded into several local shards) share
    # one span: the first in-place destination, else one buffer.
    same: dict[tuple[int, int], list[Request]] = defaultdict(list)
    for item, location in requests:
        same[(location.offset, location.length)].append((item, location))
    spans: list[tuple[int, memoryview]] = []
    checks: list[tuple[ItemLocation, memoryview]] = []
    in_place: list[tuple[ReadItem, torch.Tensor]] = []
    later: list[tuple[ReadItem, ItemLocation, memoryview]] = []
    for (offset, length), group in sorted(same.items()):
        targets = [in_place_target(item, location, planner) for item, location in group]
        found = [(i, target) for i, target in enumerate(targets) if target is not None]
        lead = found[0][0] if found else None
        if found:
            data = memory_of(found[0][1])
            in_place.append((group[found[0][0]][0], found[0][1]))
        else:
            data = memoryview(bytearray(length))
        later += [(item, location, data) for i, (item, location) in enumerate(group) if i != lead]
        spans.append((offset, data))
        checks.append((group[0][1], data))
    try:
        cut = pieces(spans, max(tier.capabilities.read_size, 2**20))
    except ValueError:  # items partly over the same bytes: not a layout tierstore writes
        read_items(session, requests, planner)
        return
    with ThreadPoolExecutor(max(1, tier.capabilities.read_count), thread_name_prefix="tierstore-get") as pool:
        list(pool.map(lambda p: tier.read_into(full, p.offset, p.outs), cut))
    session.count(sum(length for _, length in same))
    for location, data in checks:  # S3 sends no checksum for a range: ours, before use
        if not is_intact(location, data):
            logger.warning(
                "tier %s: %s: bytes %d..%d do not match their CRC32C: reading them again",
                tier.name,
                full,
                location.offset,
                location.offset + location.length,
            )
            read_item(tier, full, location, data, attempts=ATTEMPTS - 1)
    for item, location, data in later:  # before any commit: a planner may move the data
        deliver(tier.name, item, location, data, planner)
    for item, target in in_place:
        planner.commit_tensor(item, target)


def pieces(spans: list[tuple[int, memoryview]], chunk: int) -> list[Piece]:
    """Cut ``spans`` (``(offset, destination)``, sorted, not overlapping) into GETs of at most
    ``chunk`` bytes. Raises ``ValueError`` when two spans overlap."""
    found: list[Piece] = []
    room, end = 0, -1
    for offset, view in _with_padding(spans):
        if not found or offset != end:  # a gap worth skipping: a new GET
            found.append(Piece(offset))
            room = chunk
        position = 0
        while position < len(view):
            if not room:
                found.append(Piece(offset + position))
                room = chunk
            take = min(room, len(view) - position)
            found[-1].outs.append(view[position : position + take])
            position, room = position + take, room - take
        end = offset + len(view)
    return found


def _with_padding(spans: list[tuple[int, memoryview]]) -> list[tuple[int, memoryview]]:
    """``spans`` without empty ones, with scratch for gaps up to :data:`SKIP_GAP` between them."""
    padded: list[tuple[int, memoryview]] = []
    end = -1
    for offset, view in spans:
        if offset < end:
            raise ValueError(f"spans overlap at byte {offset}")
        if not len(view):
            continue
        if padded and 0 < offset - end <= SKIP_GAP:
            padded.append((end, memoryview(bytearray(offset - end))))
        padded.append((offset, view))
        end = offset + len(view)
    return padded
