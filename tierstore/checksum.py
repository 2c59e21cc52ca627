"""Checksums: CRC32C (Castagnoli), which every marker records and every copy is verified against, and
SHA-256, which markers also record when the job signs them (:mod:`tierstore.signing`).

CRC32C catches corruption, not forgery: anyone who can write a tier can make a file with the same size
and CRC32C. A signed marker therefore names each file's SHA-256 too, and a reader with the key checks it.
"""

from __future__ import annotations

import hashlib

import crc32c as _crc32c

Buffer = bytes | bytearray | memoryview


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (feed a file chunk by chunk)."""
    return int(_crc32c.crc32c(data, value))


def sha256_hex(data: Buffer) -> str:
    """SHA-256 of ``data`` as 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


class Digest:
    """A file's CRC32C and, when asked for (``sha256=True``), its SHA-256, fed chunk by chunk.

    Both release the GIL on large chunks, so a helper thread can run them beside a write.
    """

    def __init__(self, *, sha256: bool) -> None:
        self.crc = 0
        self._sha = hashlib.sha256() if sha256 else None

    def update(self, data: Buffer) -> None:
        """Fold the next chunk into both checksums."""
        self.crc = crc32c(data, self.crc)
        if self._sha is not None:
            self._sha.update(data)

    @property
    def sha256(self) -> str | None:
        """The SHA-256 so far (64 hex digits); None when not asked for."""
        return None if self._sha is None else self._sha.hexdigest()
