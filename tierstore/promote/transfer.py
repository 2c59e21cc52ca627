"""Copying committed bytes between tiers: the same bytes, verified on the way, never re-serialised.

Each file is streamed from the source to the target and its size and CRC32C (and SHA-256, when the
marker is signed) are checked against the source's marker while it passes; a mismatch aborts that
file before it becomes visible in the target (POSIX: the temp file is dropped; S3: the multipart
upload is aborted) and raises
:class:`~tierstore.errors.IntegrityError` naming tier and file. No torch on this path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from tierstore._platform.bounded import Blame
from tierstore._platform.killpoints import kill_point
from tierstore._platform.runtime import map_on_daemons
from tierstore.checksum import Digest
from tierstore.errors import IntegrityError
from tierstore.ids import checkpoint_file
from tierstore.records.marker import FileEntry, entry_problem
from tierstore.tiers import Tier

CHUNK = 8 * 2**20


class Cancelled(Exception):  # noqa: N818 - a control-flow signal, not an error condition
    """The copy was asked to stop; nothing it was writing became visible."""


def _chunks(source: Tier, path: str, chunk: int) -> Iterator[bytes]:
    """The source file, chunk by chunk; a missing source is an :class:`IntegrityError`."""
    try:
        yield from source.iter_chunks(path, chunk)
    except FileNotFoundError:
        raise IntegrityError(f"tier {source.name}: {path}: missing; not promoted") from None


def _has_verified_copy(target: Tier, path: str, entry: FileEntry, progress: Callable[[int], None]) -> bool:
    """A target file of the right size and CRC32C is complete: an atomic rename put it there. Only
    looked for where reading it back is cheap (local files): elsewhere it is copied again.
    ``progress(0)`` after each chunk read back."""
    if target.local is None:
        return False
    try:
        if target.stat(path).size != entry.size:
            return False
        digest = Digest(sha256=entry.sha256 is not None)
        for data in target.iter_chunks(path, CHUNK):
            digest.update(data)
            progress(0)
    except FileNotFoundError:
        return False
    return entry_problem(path, entry, entry.size, digest.crc, digest.sha256) is None


def copy_file(
    source: Tier,
    target: Tier,
    path: str,
    entry: FileEntry,
    *,
    cancel: threading.Event | None = None,
    progress: Callable[[int], None] = lambda _count: None,
    blame: Blame | None = None,
) -> int:
    """Copy ``path`` (tier-relative) from ``source`` to ``target``, verified against ``entry``.
    ``blame`` is told of each read of the source (a hung one is the source's fault).

    Returns the bytes copied (0 when a verified copy was already there). Raises
    :class:`IntegrityError` when the source does not match ``entry`` and :class:`Cancelled` when
    ``cancel`` is set mid-copy; in both cases nothing is left under ``path`` in the target.
    """
    if _has_verified_copy(target, path, entry, progress):
        progress(entry.size)
        return 0
    chunk = target.capabilities.transfer_chunk
    size, digest = 0, Digest(sha256=entry.sha256 is not None)
    reading = blame.into_other if blame is not None else contextlib.nullcontext
    chunks = _chunks(source, path, chunk)
    with target.open_write(path) as stream:
        while True:
            with reading():
                data = next(chunks, None)
            if data is None:
                break
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"copy of {path} to {target.name} cancelled")
            size += len(data)
            digest.update(data)
            stream.write(data)
            kill_point("promote.mid_copy", path)
            progress(len(data))
        if size != entry.size or digest.crc != entry.crc32c:
            raise IntegrityError(
                f"tier {source.name}: {path}: {size} bytes with CRC32C {digest.crc:08x}, marker"
                f" says {entry.size} bytes with {entry.crc32c:08x}; not promoted"
            )
        if problem := entry_problem(path, entry, size, digest.crc, digest.sha256):
            raise IntegrityError(f"tier {source.name}: {problem}; not promoted")
    return size


def copy_files(
    source: Tier,
    target: Tier,
    checkpoint_id: str,
    entries: list[FileEntry],
    *,
    workers: int,
    stopping: threading.Event,
    cancel: threading.Event,
    progress: Callable[[int], None] = lambda _count: None,
    blame: Blame | None = None,
) -> int:
    """Copy several files of one checkpoint in parallel; return the bytes copied.

    Once ``stopping`` is set no new file starts; ``cancel`` aborts the files in flight. Raises the
    first failure (no file starts after it; the others in flight end first).
    """

    def one(entry: FileEntry) -> int:
        if stopping.is_set():
            raise Cancelled("stopping: file not started")
        return copy_file(
            source,
            target,
            checkpoint_file(checkpoint_id, entry.path),
            entry,
            cancel=cancel,
            progress=progress,
            blame=blame,
        )

    # Daemons: a copy left hanging in a tier that stopped answering (its promotion given up on,
    # :meth:`tierstore.promote.context.Context.bounded`) must not hold the process's exit.
    largest_first = sorted(entries, key=lambda e: -e.size)
    return sum(map_on_daemons(largest_first, one, width=workers, name="tierstore-copy").values())
