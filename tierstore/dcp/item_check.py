"""Every item a restore hands to DCP is checked against the CRC32C recorded for it at save time.

A copy is verified when it is chosen only if ``verify_on_load`` says so, and even then the bytes
read afterwards are other bytes: a ranged S3 GET carries no checksum (a byte flipped in transit
arrives silently), and a file can change between the check and the read. So each item's bytes are
checked as they are read, against :attr:`~tierstore.dcp.layout.ItemLocation.crc`. A mismatch is
read again (a flip in transit is transient) and, if it stays, fails the load with an
:class:`~tierstore.errors.IntegrityError` naming tier, file and bytes, and saying what to do.

Reads fill their destination a chunk at a time and fold each chunk into the CRC while it is still in
cache, so the check costs a fraction of a second pass over memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tierstore.checksum import crc32c
from tierstore.dcp.layout import CHUNK, ItemLocation
from tierstore.errors import IntegrityError

logger = logging.getLogger(__name__)

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
