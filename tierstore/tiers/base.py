"""The ``Tier`` seam: the few verbs every storage tier offers, and what each guarantees.

Paths are tier-relative, ``/``-separated and built only by :mod:`tierstore.ids`. Every method may be
called from any thread. Errors below this seam are Python builtins:

* ``FileNotFoundError``: the file (or object) does not exist;
* ``FileExistsError``: a create-only :meth:`Tier.publish` found the name taken;
* :class:`~tierstore.errors.TierUnavailableError`: the tier cannot be reached or written at all
  (unreachable endpoint, missing bucket, permission denied, disk full). Its message names the tier.

Durability: when :meth:`Tier.open_write` 's block exits normally, or :meth:`Tier.publish` returns, the
bytes are durable in the tier and visible under their final name (POSIX: temp file, ``fsync``, rename,
``fsync`` of the directory; S3: the PUT or the multipart upload completed). If the block raises, nothing
is visible under the final name and temporary data is discarded. A reader therefore never sees a
partial file under a real name.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

Progress = Callable[[int], None]
"""Called with the number of bytes just transferred."""


@dataclass(frozen=True)
class FileInfo:
    """One file (object) in a tier: tier-relative ``path``, ``size`` in bytes, ``mtime`` (epoch s)."""

    path: str
    size: int
    mtime: float


class WriteStream(Protocol):
    """What :meth:`Tier.open_write` yields: append bytes; the tier publishes them on exit."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        """Append ``data``; return the number of bytes taken (all of them)."""
        ...


class Tier(abc.ABC):
    """One storage tier, rooted at ``<configured path or url>/<namespace>``.

    Capability flags tell callers which fast paths apply: ``local_path`` returns a real file path on
    POSIX tiers (mmap, ``pread`` into tensors, same-filesystem ``adopt``); S3 returns None.
    """

    name: str
    """The tier's configured name."""
    type: str
    """``memory``, ``local``, ``shared`` or ``s3``."""
    node_local: bool
    """True when each node has its own copy of this tier."""
    root: str
    """Human-readable location of the tier root (directory or ``s3://`` URL)."""

    def describe(self) -> str:
        """``name (type, root)`` for messages."""
        return f"{self.name} ({self.type}, {self.root})"

    @abc.abstractmethod
    def open_write(self, path: str) -> AbstractContextManager[WriteStream]:
        """Stream a new file to ``path``; it appears, durable and complete, only on normal exit.

        An existing file at ``path`` is replaced atomically. Parent directories are created.
        """

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        """Write ``data`` to ``path`` durably and atomically (see :meth:`open_write`)."""
        with self.open_write(path) as stream:
            stream.write(data)

    @abc.abstractmethod
    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        """Durably publish a small file (a commit marker) in one atomic step.

        With ``create_only`` the publish fails with ``FileExistsError`` if ``path`` exists, so two
        writers racing on one name cannot both succeed (S3: ``If-None-Match: *``).
        """

    @abc.abstractmethod
    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes from ``offset`` (to the end when None). ``FileNotFoundError``."""

    def read_bytes(self, path: str) -> bytes:
        """Read the whole file."""
        return self.read_range(path, 0, None)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes from ``offset``; ``EOFError`` if the file is shorter."""
        data = self.read_range(path, offset, len(out))
        if len(data) != len(out):
            raise EOFError(f"{self.name}: {path}: expected {len(out)} bytes at {offset}")
        out[:] = data

    @abc.abstractmethod
    def stat(self, path: str) -> FileInfo:
        """Size and modification time of ``path``; ``FileNotFoundError`` if absent."""

    def exists(self, path: str) -> bool:
        """True when ``path`` exists as a file."""
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    @abc.abstractmethod
    def list_dir(self, path: str = "") -> list[str]:
        """Names of the direct children (files and directories) of ``path``; [] if it is absent."""

    @abc.abstractmethod
    def find(self, path: str = "") -> list[FileInfo]:
        """Every file below ``path``, recursively; [] if it is absent. Temporary files are hidden."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete one file; a missing file is not an error."""

    @abc.abstractmethod
    def delete_tree(self, path: str) -> None:
        """Delete ``path`` and everything below it; a missing tree is not an error."""

    def local_path(self, path: str) -> str | None:
        """A real filesystem path for ``path`` on POSIX tiers; None on object stores."""
        return None

    def upload_file(self, path: str, local_file: str, progress: Progress | None = None) -> None:
        """Copy a local file into the tier at ``path`` (durable and atomic, as :meth:`open_write`)."""
        with open(local_file, "rb") as source, self.open_write(path) as stream:
            for chunk in iter(lambda: source.read(8 * 2**20), b""):
                stream.write(chunk)
                if progress:
                    progress(len(chunk))

    def iter_chunks(self, path: str, chunk_size: int = 8 * 2**20) -> Iterator[bytes]:
        """Yield the file in chunks (for checksums and copies)."""
        size = self.stat(path).size
        for offset in range(0, size, chunk_size):
            yield self.read_range(path, offset, min(chunk_size, size - offset))
