"""A restore's items from one object in an object store: large ranged GETs, or item by item.

When the items need more than half the object, it is fetched in parallel ranged GETs, each streamed
into the destination tensors themselves where they take the stored bytes as they are
(:mod:`tierstore.dcp.object_read`); the other items are decoded from their own buffers. S3 sends no
checksum for a range: every item is checked against its CRC32C before use, and read again once on a
mismatch (:mod:`tierstore.dcp.item_check`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from tierstore.dcp.item_check import ATTEMPTS, is_intact
from tierstore.dcp.layout import ItemLocation, memory_of
from tierstore.dcp.object_read import in_place_target, pieces
from tierstore.dcp.restore_items import Request, deliver, read_item, read_items
from tierstore.dcp.restore_session import RestoreSession
from tierstore.ids import checkpoint_file

# The restore's lines keep the logger name users configure for it (see examples/quickstart.py).
logger = logging.getLogger("tierstore.dcp.reader")

_WHOLE_FILE_FRACTION = 0.5
"""Read an object in large GETs when the items need more than this share of it, else item by item."""


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
        list(pool.map(lambda p: tier.read_scattered(full, p.offset, p.outs), cut))
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
