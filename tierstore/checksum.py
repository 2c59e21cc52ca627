"""CRC32C (Castagnoli): the checksum every marker records and every copy is verified against."""

from __future__ import annotations

import crc32c as _crc32c

Buffer = bytes | bytearray | memoryview


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (feed a file chunk by chunk)."""
    return int(_crc32c.crc32c(data, value))
