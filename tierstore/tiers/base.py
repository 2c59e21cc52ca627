"""The ``Tier`` seam: the verbs every storage tier offers, what each guarantees, what a tier can do.

Callers outside ``tierstore/tiers/`` see only this module: they call a tier's verbs, pick transfer sizes
by its :attr:`Tier.capabilities`, and reach files of this host through :attr:`Tier.local` (None where
a tier has none); they never test for an adapter class. A tier *type* is one
module that defines a :class:`TierConfig` subclass (its YAML fields and a ``build`` factory) and a
:class:`Tier` subclass, and registers the config model (:func:`tierstore.tiers.registry.register`).

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
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import Field, field_validator

from tierstore.tiers.landing import Landing
from tierstore.units import StrictModel

TIER_NAME_PATTERN = r"[A-Za-z0-9_-]+"

RetryHook = Callable[[str, BaseException], None]
"""Told a tier's name and each transient error it retries (metrics), in the process that built it."""


@dataclass(frozen=True)
class FileInfo:
    """One file (object) in a tier: tier-relative ``path``, ``size`` in bytes, ``mtime`` (epoch s)."""

    path: str
    size: int
    mtime: float


@dataclass(frozen=True)
class Space:
    """How full the storage under a tier is: the filesystem's ``used`` and ``total`` bytes, and the
    bytes this process may still write there (``free``: what a non-root writer can take)."""

    used: int
    total: int
    free: int


@dataclass(frozen=True)
class OwnedDirectory:
    """A directory of a tier's filesystem that this process keeps its own files in (see
    :meth:`Tier.own_directory`): its real ``path``, and ``lock``, the descriptor of its owner lock
    (closing it tells :meth:`Tier.owner_alive` that the owner is gone)."""

    path: str
    lock: int


@dataclass(frozen=True)
class IncompleteWrite:
    """A write that never published: a temp file, an incomplete multipart upload.

    ``path`` is the tier-relative name it was going to have (or its temp name); ``last_activity``
    the epoch seconds of its newest byte; ``handle`` what the tier needs to discard it.
    """

    path: str
    last_activity: float
    kind: str
    handle: str = ""


@dataclass(frozen=True)
class Capabilities:
    """How a tier's transfers are best made; callers size their reads, copies and checks by these.

    Attributes:
        transfer_chunk: the size in which copies into the tier are best made (and out of it,
            unless ``read_chunk`` says otherwise).
        transfer_streams: how many chunks are best moved at once (an object store's requests in
            flight).
        read_chunk: the size of the ranges reads are best made in (0: ``transfer_chunk``).
        read_streams: how many ranges are best read at once (0: ``transfer_streams``).
        listing_page: how many files one request of :meth:`Tier.find` returns where listing is
            cheaper than asking for each file (an object store: a LIST per 1,000 keys against a
            HEAD per key); 0 where it is not (files of a filesystem: a ``stat`` each).
    """

    transfer_chunk: int = 8 * 2**20
    transfer_streams: int = 4
    read_chunk: int = 0
    read_streams: int = 0
    listing_page: int = 0

    @property
    def read_size(self) -> int:
        """The size reads are best made in."""
        return self.read_chunk or self.transfer_chunk

    @property
    def read_count(self) -> int:
        """How many reads are best made at once."""
        return self.read_streams or self.transfer_streams


class WriteStream(Protocol):
    """What :meth:`Tier.open_write` yields: append bytes; the tier publishes them on exit."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        """Append ``data``; return the number of bytes taken (all of them)."""


class LocalFace(Protocol):
    """The verbs of a tier whose files are files of this host (memory, local, shared):
    :attr:`Tier.local`. Paths are tier-relative; a real path leaves ``tiers/`` only as an
    :class:`OwnedDirectory` or a :class:`Landing`."""

    staging: bool
    """Writers may stage a save in files inside the tier, which become its data files (host memory)."""

    def map_file(self, path: str) -> memoryview:
        """The bytes of the file ``path``, mapped without a copy (a private mapping: a write through
        the view never reaches the file), for as long as the view lives. ``FileNotFoundError``."""

    def own_directory(self, path: str) -> OwnedDirectory:
        """Create the directory ``path`` and lock it as this process's own (a writer's staging
        buffers, a mirror's spares): :meth:`owner_alive` answers True until the process exits or
        closes the lock. The caller keeps its files in it by real path and removes them.
        ``OSError`` if it cannot be created or is locked already."""

    def owner_alive(self, path: str) -> bool | None:
        """Whether the process that locked the directory ``path`` still runs; None when it holds
        no lock file (:mod:`tierstore._platform.owners`)."""

    def directory_mtime(self, path: str) -> float | None:
        """When the directory ``path`` was last touched (epoch s), None if it is missing."""

    def open_landing(self, path: str, size: int, spare: str | None = None) -> Landing:
        """A file of ``size`` bytes, its pages reserved, that becomes ``path`` through
        :meth:`adopt` once its bytes are checked (``spare``: a file of that size reserved earlier
        in this filesystem). ``OSError`` (ENOSPC) when there is no room."""

    def adopt(self, path: str, source_file: str) -> None:
        """Move ``source_file`` (durable, on this filesystem) to ``path`` without copying."""

    def recycle(self, path: str, into: str) -> None:
        """Move the file ``path`` out of the tier, without copying, to ``into`` (in a directory of
        :meth:`own_directory`): its pages are reused instead of freed. When this returns, ``path``
        no longer names it (both directories fsynced). ``ValueError`` unless it is a regular file
        with one name, ``FileNotFoundError`` if it is absent."""

    def remove_if_empty(self, path: str) -> None:
        """Remove the directory ``path`` if, at that instant, nothing is in it (atomic: a file
        created concurrently keeps it)."""

    def space(self) -> Space:
        """How full the filesystem holding the tier is. May block as long as a listing: ask it
        within ``probe_timeout``."""


def is_host_memory(tier: Tier) -> bool:
    """True for a tier in this host's memory (writers stage in it): it cannot hang, so it is asked
    without a deadline."""
    return (local := tier.local) is not None and local.staging


class Tier(abc.ABC):
    """One storage tier, rooted at ``<configured path or url>/<namespace>``."""

    name: str
    """The tier's configured name."""
    type: str
    """The registered tier type (``memory``, ``local``, ``shared``, ``s3``, ...)."""
    node_local: bool
    """True when each node has its own copy of this tier."""
    root: str
    """Human-readable location of the tier root (directory or ``s3://`` URL)."""
    capabilities: Capabilities = Capabilities()
    """How its transfers are best made (see :class:`Capabilities`)."""

    @property
    def local(self) -> LocalFace | None:
        """The verbs of files of this host (:class:`LocalFace`); None for a tier without them."""
        return None

    def describe(self) -> str:
        """``name (type, root)`` for messages."""
        return f"{self.name} ({self.type}, {self.root})"

    @property
    def health_key(self) -> str:
        """What tells this tier's store apart from any other in the process, for its health
        (:mod:`tierstore._platform.health`): two configurations may give one name to two stores."""
        return f"{self.type} {self.root}"

    # -- writing ---------------------------------------------------------------------------------

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
        writers racing on one name cannot both succeed (the store enforces it where it can:
        ``link``, ``If-None-Match: *``).
        """

    # -- reading ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes from ``offset`` (to the end when None). ``FileNotFoundError``."""

    def read_bytes(self, path: str) -> bytes:
        """Read the whole file."""
        return self.read_range(path, 0, None)

    def read_into(self, path: str, offset: int, out: memoryview | Sequence[memoryview]) -> None:
        """Fill ``out`` (one buffer, or several in order: one contiguous range) with the bytes from
        ``offset`` on; ``EOFError`` if the file is shorter. Object stores make it one request."""
        for view in [out] if isinstance(out, memoryview) else out:
            data = self.read_range(path, offset, len(view))
            if len(data) != len(view):
                raise EOFError(f"{self.name}: {path}: expected {len(view)} bytes at {offset}")
            view[:] = data
            offset += len(view)

    def iter_chunks(self, path: str, chunk_size: int | None = None) -> Iterator[bytes]:
        """Yield the file in chunks (for checksums and copies)."""
        chunk = chunk_size or self.capabilities.read_size
        size = self.stat(path).size
        for offset in range(0, size, chunk):
            yield self.read_range(path, offset, min(chunk, size - offset))

    # -- listing ---------------------------------------------------------------------------------

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
    def find(self, path: str = "", *, after: str | None = None) -> list[FileInfo]:
        """Every file below ``path``, recursively, sorted by path; [] if it is absent. Temporary
        files are hidden. ``after``: only those whose tier-relative path sorts after it (stores
        that list in key order start there: S3's ``StartAfter``)."""

    def find_in_children(self, name: str, *, besides: str | None = None) -> dict[str, FileInfo]:
        """``{child: info}`` for every direct child directory of the root holding a file ``name``,
        but ``besides`` (a child holding many files and no ``name``, which a store that lists
        keys need not page through).

        One listing pass (the catalog's marker scan); adapters override it with a cheaper one.
        """
        found: dict[str, FileInfo] = {}
        for info in self.find(""):
            parts = info.path.split("/")
            if len(parts) == 2 and parts[1] == name and parts[0] != besides:
                found[parts[0]] = info
        return found

    # -- deleting and cleaning up ------------------------------------------------------------------

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete one file; a missing file is not an error."""

    @abc.abstractmethod
    def delete_tree(self, path: str) -> None:
        """Delete ``path`` and everything below it; a missing tree is not an error."""

    def incomplete_writes(self, *, idle_for: float, now: float) -> list[IncompleteWrite]:
        """Writes that never published and saw no byte for ``idle_for`` seconds (for cleanup).

        Temp files of interrupted writes, incomplete multipart uploads. A write still in progress
        keeps its activity time young; only idle ones are listed.
        """
        return []

    def discard_incomplete(self, write: IncompleteWrite) -> None:
        """Remove one write listed by :meth:`incomplete_writes` (gone already is fine)."""
        self.delete(write.path)


class TierConfig(StrictModel):
    """The YAML storage fields every tier has; each tier type's model adds its own and a ``build``
    factory. A tier's retention and promotion keys (``keep``, ...) are not a tier's business: the
    configuration parts them off at load (:mod:`tierstore.policy_config`).

    Subclasses declare ``type: Literal["<name>"]`` and register themselves with
    :func:`tierstore.tiers.registry.register`.
    """

    type: str
    name: str = Field(description="Unique tier name, used by `tier=` and in the CLI.")

    node_local: ClassVar[bool] = False
    """True when each node has its own copy of this tier type (its path may contain ``{node}``)."""

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        if not re.fullmatch(TIER_NAME_PATTERN, value):
            raise ValueError(f"expected letters, digits, '_' or '-', got {value!r}")
        return value

    @classmethod
    def resolve_relative(cls, data: dict[str, Any], base: Path) -> dict[str, Any]:
        """Make relative locations in the raw YAML mapping relative to ``base`` (the YAML's folder)."""
        return data

    def check_usable(self, *, node: int, namespace: str | None) -> tuple[str, str] | None:
        """``(key, what was expected)`` if the tier cannot be used from ``node``; None if it can.

        Called once at load time (POSIX tiers create and probe their directory).
        """
        return None

    @abc.abstractmethod
    def build(self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None) -> Tier:
        """The tier, rooted at its location plus ``namespace``, as seen from ``node``; a tier that
        retries tells ``on_retry`` of each transient error."""
