"""A restore's items one by one: each read checked against its CRC32C, then handed to DCP's planner.

On a POSIX tier an item whose destination is exactly the stored chunk is read straight into it
(``preadv``); any other item is read into its own buffer, decoded and copied. Byte items are checked
like tensors, before DCP unpickles them. Used for the local tiers' parallel reads, for an object's
items when they are few (:mod:`tierstore.dcp.restore.objects`), and to deliver bytes already read.

Why every item: a copy is verified when it is chosen only if ``verify_on_load`` says so, and even
then the bytes read afterwards are other bytes: a ranged S3 GET carries no checksum (a byte flipped
in transit arrives silently), and a file can change between the check and the read. A mismatch is
read again (a flip in transit is transient) and, if it stays, fails the load with an
:class:`~tierstore.errors.IntegrityError` naming tier, file and bytes, and saying what to do. Reads
fold each chunk into the CRC while it is cache-hot: the check costs a fraction of a pass over memory.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from tierstore.checksum import crc32c
from tierstore.dcp.layout import CHUNK, ItemLocation, decode_tensor, memory_of, to_dtype
from tierstore.dcp.restore.session import RestoreSession, logger
from tierstore.errors import IntegrityError
from tierstore.tiers import Tier

Request = tuple[ReadItem, ItemLocation]
"""An item DCP asks for and where the chosen copy stores it."""

ATTEMPTS = 3
"""Reads of an item whose bytes do not match its CRC32C before the load fails."""

Fill = Callable[[int, memoryview], None]
"""``fill(offset, out)``: read ``len(out)`` bytes of the file at ``offset`` into ``out``."""


def fill_summing(fill: Fill, offset: int, out: memoryview, start: int, chunk: int = CHUNK) -> int:
    """Fill ``out`` from ``offset`` in reads of ``chunk`` bytes; return the CRC32C of its bytes,
    continued from ``start``, each chunk folded in while it is cache-hot."""
    crc = start
    for position in range(0, len(out), chunk):
        part = out[position : position + chunk]
        fill(offset + position, part)
        crc = crc32c(part, crc)
    return crc


def is_intact(location: ItemLocation, data: memoryview | bytes | bytearray) -> bool:
    """Whether ``data`` matches the item's recorded CRC32C (True when none was recorded)."""
    return location.crc is None or crc32c(data, location.crc[0]) == location.crc[1]


def read_once_checked(fill: Fill, location: ItemLocation, out: memoryview) -> bool:
    """Read the item into ``out`` once, in chunks; whether its bytes match its CRC32C (True when
    none was recorded: the caller verifies such files whole). Logs nothing: the caller decides."""
    if location.crc is None:
        fill(location.offset, out)
        return True
    before, after = location.crc
    try:
        return fill_summing(fill, location.offset, out, before) == after
    except EOFError:
        return False  # the caller's checked read says how short the file is


def read_checked(
    fill: Fill,
    location: ItemLocation,
    out: memoryview,
    *,
    tier: str,
    full: str,
    attempts: int = ATTEMPTS,
    chunk: int = CHUNK,
) -> None:
    """Read the item at ``location`` into ``out`` until its bytes match its CRC32C, at most
    ``attempts`` times, in reads of ``chunk`` bytes (one per item on an object store: each read
    is a request). ``full`` is the tier-relative path of the file. Raises
    :class:`IntegrityError` when no read matched. Without a recorded CRC it reads once, unchecked:
    the caller verifies such files whole."""
    if location.crc is None:
        fill(location.offset, out)
        return
    before, after = location.crc
    for attempt in range(1, attempts + 1):
        try:
            summed = fill_summing(fill, location.offset, out, before, chunk)
        except EOFError:
            raise _cut_short(tier, full, location) from None
        if summed == after:
            if attempt > 1:
                logger.warning(
                    "tier %s: %s: bytes %d..%d matched their CRC32C on read %d",
                    tier,
                    full,
                    location.offset,
                    location.offset + location.length,
                    attempt,
                )
            return
        logger.warning(
            "tier %s: %s: bytes %d..%d do not match their CRC32C (read %d of %d)",
            tier,
            full,
            location.offset,
            location.offset + location.length,
            attempt,
            attempts,
        )
    raise damaged(tier, full, location, reads=attempts)


def _cut_short(tier: str, full: str, location: ItemLocation) -> IntegrityError:
    checkpoint_id = full.split("/", 1)[0]
    return IntegrityError(
        f"tier {tier}: {full}: the file ends before byte {location.offset + location.length}: it"
        f" is shorter than its commit marker says, so the copy in tier {tier} is damaged."
        f" `tierstore verify {checkpoint_id}` checks every copy; delete the damaged one and load"
        " again to restore from the next tier, or set verify_on_load: true so a damaged copy is"
        " skipped before loading"
    )


def damaged(tier: str, full: str, location: ItemLocation, *, reads: int) -> IntegrityError:
    """The error for an item whose bytes never matched its CRC32C in ``reads`` reads."""
    checkpoint_id = full.split("/", 1)[0]
    return IntegrityError(
        f"tier {tier}: {full}: bytes {location.offset}..{location.offset + location.length} did"
        f" not match the CRC32C recorded at save time in {reads} reads: the copy in tier {tier}"
        f" is damaged (or the path to it corrupts data). `tierstore verify {checkpoint_id}` checks"
        " every copy; delete the damaged one and load again to restore from the next tier, or set"
        " verify_on_load: true so a damaged copy is skipped before loading"
    )


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
    """Read an item into ``out`` from the chosen ``tier``, checked against its CRC32C."""
    # POSIX: chunked reads, each summed while cache-hot; an object store: one request.
    chunk = CHUNK if tier.local is not None else max(1, len(out))
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


def in_place_target(item: ReadItem, location: ItemLocation, planner: LoadPlanner) -> torch.Tensor | None:
    """The destination tensor when its memory can take the stored bytes as they are, else None."""
    if item.type == LoadItemType.BYTE_IO or location.encoding != "raw" or location.shape is None:
        return None
    target = planner.resolve_tensor(item).detach()
    whole_chunk = all(o == 0 for o in item.storage_offsets) and list(item.lengths) == list(location.shape)
    fits = (
        whole_chunk
        and target.device.type == "cpu"
        and not target.is_conj()  # a lazily conjugated or negated view reads its memory
        and not target.is_neg()  # through that bit: raw bytes would come back transformed
        and target.is_contiguous()
        and target.dtype == to_dtype(location.dtype or "uint8")
        and target.numel() * target.element_size() == location.length
    )
    return target if fits else None


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
    if tier.local is None:
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
