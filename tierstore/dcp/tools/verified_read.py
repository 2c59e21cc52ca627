"""Reading one stored file front to back, once, checking it against its commit-marker entry.

An export needs every item of a data file and must verify the whole file (header and padding
included) against the CRC32C in the marker (and its SHA-256, when the marker is signed). Reading
the file once, in order, does both: every byte passes through the checksums on its way, items are
cut out of the stream as they go by, and the
comparison with the marker happens when the end is reached. Nothing read is trusted before
:meth:`VerifiedReader.finish` returns, so callers write what they read only somewhere they can
discard. The next chunk is fetched while the caller works on the current one (an S3 GET overlaps
the conversion).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor

from tierstore.checksum import Digest
from tierstore.errors import IntegrityError
from tierstore.records.marker import FileEntry, entry_problem
from tierstore.tiers import Tier


def _read_ahead(chunks: Iterator[bytes]) -> Generator[bytes, None, None]:
    """Yield ``chunks`` while the next one is already being fetched on a helper thread."""
    with ThreadPoolExecutor(1, thread_name_prefix="tierstore-readahead") as pool:
        pending = pool.submit(next, chunks, None)
        while (chunk := pending.result()) is not None:
            pending = pool.submit(next, chunks, None)
            yield chunk


class VerifiedReader:
    """Forward-only reads of ``path`` in ``tier``; :meth:`finish` checks size and CRC32C.

    Use it as a context manager so the read-ahead thread stops even when the caller fails midway.
    Raises :class:`IntegrityError` naming the tier and file: from :meth:`read` when the file ends
    before the requested range or a range starts behind one already read, from :meth:`finish` when
    the size or CRC32C differs from ``entry``.
    """

    def __init__(self, tier: Tier, path: str, entry: FileEntry) -> None:
        self.tier, self.path, self.entry = tier, path, entry
        self._chunks = _read_ahead(tier.iter_chunks(path))
        self._pending = memoryview(b"")
        self._position = 0
        self._digest = Digest(sha256=entry.sha256 is not None)

    def __enter__(self) -> VerifiedReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._chunks.close()  # stops the read-ahead thread

    def _where(self) -> str:
        return f"tier {self.tier.name}: {self.path}"

    def _refill(self) -> bool:
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        self._digest.update(chunk)
        self._pending = memoryview(chunk)
        return True

    def _consume(self, length: int, out: memoryview | None) -> None:
        done = 0
        while done < length:
            if not self._pending and not self._refill():
                raise IntegrityError(
                    f"{self._where()}: ends at byte {self._position}, expected at least"
                    f" {self._position + length - done} (marker says {self.entry.size})"
                )
            take = min(len(self._pending), length - done)
            if out is not None:
                out[done : done + take] = self._pending[:take]
            self._pending = self._pending[take:]
            done += take
            self._position += take

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the ``len(out)`` bytes at ``offset``; offsets must not go backwards.

        The caller supplies (and reuses) the buffer: filling fresh memory for every item costs
        more than the copy itself.
        """
        if offset < self._position:
            raise IntegrityError(
                f"{self._where()}: item at byte {offset} overlaps the one before (read up to"
                f" {self._position})"
            )
        self._consume(offset - self._position, None)
        self._consume(len(out), out)

    def finish(self) -> int:
        """Read the rest and compare size and CRC32C with the marker; return the size."""
        while self._pending or self._refill():
            self._position += len(self._pending)
            self._pending = memoryview(b"")
        problem = entry_problem(self.path, self.entry, self._position, self._digest.crc, self._digest.sha256)
        if problem is not None:
            raise IntegrityError(f"tier {self.tier.name}: {problem}")
        return self._position
