"""A restore's items one by one: each read checked against its CRC32C, then handed to DCP's planner.

On a POSIX tier an item whose destination is exactly the stored chunk is read straight into it
(``preadv``); any other item is read into its own buffer, decoded and copied. Byte items are checked
like tensors, before DCP unpickles them. Used for the local tiers' parallel reads, for an object's
items when they are few (:mod:`tierstore.dcp.restore_object`), and to deliver bytes already read.
"""

from __future__ import annotations

import functools
import io
import logging

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from tierstore.dcp.item_check import ATTEMPTS, read_checked, read_once_checked
from tierstore.dcp.layout import CHUNK, ItemLocation, decode_tensor, memory_of
from tierstore.dcp.object_read import in_place_target
from tierstore.dcp.restore_session import RestoreSession
from tierstore.errors import IntegrityError
from tierstore.tiers import Tier

logger = logging.getLogger("tierstore.dcp.reader")  # the restore's logger, as users set it

Request = tuple[ReadItem, ItemLocation]
"""An item DCP asks for and where the chosen copy stores it."""


def read_items(session: RestoreSession, requests: list[Request], planner: LoadPlanner) -> None:
    """Read, check and deliver each of ``requests`` from the chosen tier, in order."""
    tier = session.tier
    assert tier is not None
    for item, location in requests:
        full = session.stored(location.path)
        if item.type != LoadItemType.BYTE_IO and _read_in_place(session, full, item, location, planner):
            continue
        data = memoryview(bytearray(location.length))
        read_item(tier, full, location, data)  # byte items too: before DCP unpickles them
        session.count(location.length)
        deliver(tier.name, item, location, data, planner)


def read_item(
    tier: Tier, full: str, location: ItemLocation, out: memoryview, attempts: int = ATTEMPTS
) -> None:
    """Read an item into ``out`` from the chosen ``tier``, checked against its CRC32C (:mod:`.item_check`)."""
    # POSIX: chunked reads, each summed while cache-hot; an object store: one request.
    chunk = CHUNK if tier.capabilities.local_files else max(1, len(out))
    fill = functools.partial(tier.read_into, full)
    read_checked(fill, location, out, tier=tier.name, full=full, attempts=attempts, chunk=chunk)


def deliver(
    tier_name: str, item: ReadItem, location: ItemLocation, data: bytearray | memoryview, planner: LoadPlanner
) -> None:
    """Hand an item's stored bytes to the planner: loaded (byte items) or copied into its tensor."""
    if len(data) != location.length:
        raise IntegrityError(f"tier {tier_name}: {location.path}: short read at {location.offset}")
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(bytes(data)))
    else:
        _copy_into(planner, item, decode_tensor(data, location))


def balanced(requests: list[Request], parts: int) -> list[list[Request]]:
    """Split requests (kept in file order) into up to ``parts`` runs of about equal bytes."""
    total = sum(location.length for _, location in requests)
    batches: list[list[Request]] = [[]]
    share, filled = max(1, total // parts), 0
    for request in requests:
        if filled >= share and len(batches) < parts:
            batches.append([])
            filled = 0
        batches[-1].append(request)
        filled += request[1].length
    return [b for b in batches if b]


def _read_in_place(
    session: RestoreSession, full: str, item: ReadItem, location: ItemLocation, planner: LoadPlanner
) -> bool:
    """``preadv`` straight into the destination when it is exactly the stored chunk."""
    tier = session.tier
    assert tier is not None
    if not tier.capabilities.local_files:
        return False
    target = in_place_target(item, location, planner)
    if target is None:
        return False
    if location.length:
        out = memory_of(target)
        fill = functools.partial(tier.read_into, full)
        if not read_once_checked(fill, location, out):
            # Another item's destination may share this memory (tied weights, read on another
            # thread between this read and its check), or the bytes changed on the way: read into
            # a buffer of this item's own, check it there, then copy.
            logger.info(
                "tier %s: %s: bytes %d.. read again through a buffer of their own",
                tier.name,
                full,
                location.offset,
            )
            data = memoryview(bytearray(location.length))
            read_item(tier, full, location, data)
            out[:] = data
        session.count(location.length)
    planner.commit_tensor(item, target)
    return True


def _copy_into(planner: LoadPlanner, item: ReadItem, decoded: torch.Tensor) -> None:
    source = decoded
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        if length < decoded.size(dim):
            source = source.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise IntegrityError(
            f"{item.storage_index.fqn}: stored chunk {tuple(source.size())} does not fit"
            f" {tuple(target.size())}"
        )
    target.copy_(source)
    planner.commit_tensor(item, target)
