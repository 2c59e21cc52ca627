"""POSIX directory tiers (memory/tmpfs, local disk, parallel filesystem): the shared adapter and config.

Writes follow the durable-write recipe of :mod:`tierstore.tiers.durable`: write a hidden temporary
file beside the target, ``fsync`` it, ``rename`` it over the target, then ``fsync`` the directory so the
new name itself is durable.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import Field

from tierstore._platform.bounded import beat
from tierstore._platform.forks import close_unshared, open_unshared
from tierstore._platform.killpoints import kill_point
from tierstore._platform.mapping import map_private
from tierstore._platform.owners import hold_owner_lock, owner_is_alive
from tierstore.errors import TierUnavailableError
from tierstore.tiers.base import (
    FileInfo,
    IncompleteWrite,
    LocalFace,
    OwnedDirectory,
    RetryHook,
    Space,
    Tier,
    TierConfig,
    WriteStream,
)
from tierstore.tiers.durable import FdStream, fsync_dir, in_dirs, is_temporary, temp_name_for, withdraw_name
from tierstore.tiers.landing import Landing

_UNAVAILABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO}
_ADVICE = {
    errno.ENOSPC: "free space on its filesystem or lower the tier's keep",
    errno.EDQUOT: "raise the quota, free space or lower the tier's keep",
    errno.EIO: "check the device and its filesystem (kernel log); nothing is retried over an I/O error",
    errno.EROFS: "remount the filesystem read-write",
    errno.EACCES: "check the permissions of the tier's directory and files",
    errno.EPERM: "check the permissions of the tier's directory and files",
    errno.ENOTDIR: "a file stands where the tier needs a directory: move it away",
    errno.ENOENT: "check that the tier's directory exists",
}
"""What to do about each error that makes a directory tier unusable (said in its message)."""


def join_namespace(path: str, namespace: str | None) -> str:
    """The tier root: the configured directory, plus the namespace sub-folder if any."""
    return f"{path.rstrip('/')}/{namespace}" if namespace else path


class PosixTierConfig(TierConfig):
    """The fields of a directory tier: ``path`` (absolute, or relative to the YAML file)."""

    path: str = Field(description="Directory of the tier (absolute, or relative to the YAML file).")

    def path_for(self, node: int) -> str:
        """The tier directory on node ``node`` (``{node}`` replaced in node-local tiers)."""
        return self.path.replace("{node}", str(node))

    @classmethod
    def resolve_relative(cls, data: dict[str, Any], base: Path) -> dict[str, Any]:
        """A relative ``path`` is relative to the YAML file's folder."""
        if isinstance(data.get("path"), str):
            return {**data, "path": str(base / data["path"])}
        return data

    def build(self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None) -> PosixTier:
        """The tier on ``node`` (a directory never retries: no ``on_retry``)."""
        directory = join_namespace(self.path_for(node), namespace)
        return PosixTier(self.name, self.type, directory, node_local=self.node_local)

    def check_usable(self, *, node: int, namespace: str | None) -> tuple[str, str] | None:
        """Create the directory if needed and prove it writable."""
        directory = Path(join_namespace(self.path_for(node), namespace))
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".tierstore-probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return "path", (f"expected a writable directory, got {str(directory)!r} ({exc.strerror or exc})")
        return None


class PosixTier(Tier):
    """A tier that is a directory: ``<path>/<namespace>``; its own :class:`LocalFace`."""

    staging = False

    def __init__(self, name: str, type_: str, directory: str, *, node_local: bool) -> None:
        self.name = name
        self.type = type_
        self.node_local = node_local
        self.base = Path(directory)
        self.root = str(self.base)

    @property
    def local(self) -> LocalFace:
        """This tier: its files are files of this host."""
        return self

    def _path(self, path: str) -> Path:
        return self.base / path if path else self.base

    def local_path(self, path: str) -> str:
        """The real path of ``path`` in this tier: the adapters' own, and the tests' (to damage a
        file on purpose). Not part of the :class:`Tier` seam: callers elsewhere use :attr:`local`."""
        return str(self._path(path))

    def map_file(self, path: str) -> memoryview:
        """See :meth:`LocalFace.map_file` (:func:`~tierstore._platform.mapping.map_private`: pages are
        shared with the page cache until written, a write never reaches the file, the page tables
        are filled at once, and a forked child inherits neither the mapping nor a descriptor)."""
        real = str(self._path(path))
        with self._reading(path):
            try:  # a descriptor no forked child keeps (tierstore._platform.forks)
                fd = open_unshared(real, os.O_RDONLY)
            except NotADirectoryError as exc:  # a path through a foreign file
                raise FileNotFoundError(errno.ENOENT, "no such file", real) from exc
            try:
                found = os.fstat(fd)
                if stat.S_ISDIR(found.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "a directory, not a file", real)
                if found.st_size == 0:
                    return memoryview(b"")  # an empty file cannot be mapped
                return map_private(fd, found.st_size)
            finally:
                close_unshared(fd)

    def own_directory(self, path: str) -> OwnedDirectory:
        """See :meth:`LocalFace.own_directory` (an exclusive ``flock`` on its lock file,
        :mod:`tierstore._platform.owners`)."""
        directory = str(self._path(path))
        return OwnedDirectory(directory, in_dirs(Path(directory).parent, lambda: hold_owner_lock(directory)))

    def open_landing(self, path: str, size: int, spare: str | None = None) -> Landing:
        """See :meth:`LocalFace.open_landing`."""
        return Landing(str(self._path(path)), size, spare)

    def owner_alive(self, path: str) -> bool | None:
        """See :meth:`LocalFace.owner_alive`."""
        return owner_is_alive(str(self._path(path)))

    def directory_mtime(self, path: str) -> float | None:
        """See :meth:`LocalFace.directory_mtime`."""
        try:  # a string, not a Path: a promoter's pass asks this for every generation it keeps
            return os.stat(f"{self.root}/{path}" if path else self.root).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def iter_chunks(self, path: str, chunk_size: int | None = None) -> Iterator[bytes]:
        """Yield the file in chunks, read through one descriptor (``FileNotFoundError`` if
        missing, :class:`TierUnavailableError` if unreadable)."""
        chunk = chunk_size or self.capabilities.transfer_chunk
        file = self._open_for_reading(path)
        with file:
            while True:
                with self._reading(path):
                    data = file.read(chunk)
                if not data:
                    return
                yield data

    def space(self) -> Space:
        """The filesystem's usage under the tier root (its nearest existing parent before the
        first save creates it)."""
        where = self.base
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            usage = shutil.disk_usage(where)
        except OSError as exc:
            raise self._unavailable(exc, "measure the space of", str(where)) from exc
        return Space(used=usage.used, total=usage.total, free=usage.free)

    def _unavailable(self, exc: OSError, action: str, path: str) -> TierUnavailableError:
        reason = exc.strerror or str(exc)
        advice = f"; {_ADVICE[exc.errno]}" if exc.errno in _ADVICE else ""
        return TierUnavailableError(
            f"tier {self.describe()}: cannot {action} {path!r}: {reason}{advice}", tier=self.name
        )

    @contextmanager
    def open_write(self, path: str) -> Iterator[WriteStream]:
        """Stream to a hidden temp file; fsync, rename over ``path``, fsync the directory.

        A new name whose directory fsync fails is removed again; a replaced one keeps the new file
        (the old one is gone either way)."""
        target = self._path(path)
        temp = temp_name_for(target, uuid.uuid4().hex[:12])
        try:
            fd = in_dirs(target.parent, lambda: os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except OSError as exc:
            if exc.errno in _UNAVAILABLE or exc.errno in (errno.ENOTDIR, errno.ENOENT):
                raise self._unavailable(exc, "write", path) from exc
            raise
        published = False
        try:
            yield FdStream(fd)
            os.fsync(fd)  # the bytes are durable before any name points at them
            inode, fresh = os.fstat(fd).st_ino, not os.path.lexists(target)
            os.close(fd)
            fd = -1
            os.rename(temp, target)
            published = True
            try:
                fsync_dir(target.parent)  # ...and the name is durable before we report success
            except OSError:
                if fresh:
                    withdraw_name(target, inode)
                raise
        except OSError as exc:
            if exc.errno in _UNAVAILABLE:
                raise self._unavailable(exc, "write", path) from exc
            raise
        finally:
            if fd >= 0:
                os.close(fd)
            if not published:
                temp.unlink(missing_ok=True)

    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        """Temp file, fsync, then ``link`` (create-only: fails if taken) or ``rename``; fsync dir.

        If the directory fsync fails, a new name is removed again before the error is raised: a
        marker is never left standing after an fsync error (a replaced one keeps the new file)."""
        target = self._path(path)
        temp = temp_name_for(target, uuid.uuid4().hex[:12])
        try:
            fd = in_dirs(target.parent, lambda: os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            try:
                FdStream(fd).write(data)
                os.fsync(fd)
                inode = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            kill_point("posix.publish.temp_synced", path)
            fresh = create_only or not os.path.lexists(target)
            if create_only:
                try:
                    os.link(temp, target)  # atomic and exclusive: EEXIST if another writer won
                    kill_point("posix.publish.linked", path)
                finally:
                    temp.unlink(missing_ok=True)
            else:
                os.rename(temp, target)
            try:
                fsync_dir(target.parent)
            except OSError:
                if fresh:
                    withdraw_name(target, inode)
                raise
        except FileExistsError:
            raise
        except OSError as exc:
            temp.unlink(missing_ok=True)
            if exc.errno in _UNAVAILABLE or exc.errno in (errno.ENOTDIR, errno.ENOENT):
                raise self._unavailable(exc, "publish", path) from exc
            raise

    def adopt(self, path: str, source_file: str) -> None:
        """Move ``source_file`` (same filesystem; the caller fsynced it) to ``path``; fsync both dirs."""
        target = self._path(path)
        in_dirs(target.parent, lambda: os.rename(source_file, target))
        fsync_dir(target.parent)
        fsync_dir(Path(source_file).parent)

    def recycle(self, path: str, into: str) -> None:
        """See :meth:`LocalFace.recycle` (``rename``; fsync both directories)."""
        source = self._path(path)
        info = os.lstat(source)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise ValueError(f"tier {self.name}: {path} is not a file with one name: not recycled")
        os.rename(source, into)
        fsync_dir(source.parent)
        fsync_dir(Path(into).parent)

    def _open_for_reading(self, path: str) -> Any:
        """An unbuffered binary handle on ``path`` (the caller closes it); a path through a foreign
        file is a missing file."""
        with self._reading(path):
            try:
                return open(self._path(path), "rb", buffering=0)
            except NotADirectoryError as exc:
                raise FileNotFoundError(errno.ENOENT, "no such file", str(self._path(path))) from exc

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """``pread`` the range; a short file yields fewer bytes. An unreadable file (permissions,
        an I/O error) raises :class:`TierUnavailableError` naming the tier, the file and what to do."""
        file = self._open_for_reading(path)
        with file as f, self._reading(path):
            f.seek(offset)
            return f.read() if length is None else _read_exact(f, length)

    def read_into(self, path: str, offset: int, out: memoryview | Sequence[memoryview]) -> None:
        """``preadv`` straight into ``out`` (e.g. a tensor's memory): no intermediate copy."""
        with self._reading(path):
            fd = os.open(self._path(path), os.O_RDONLY)
            try:
                for buffer in [out] if isinstance(out, memoryview) else out:
                    view = buffer.cast("B")
                    while view:
                        got = os.preadv(fd, [view], offset)
                        if got == 0:
                            raise EOFError(f"{self.name}: {path}: file ends before byte {offset}")
                        view, offset = view[got:], offset + got
            finally:
                os.close(fd)

    @contextmanager
    def _reading(self, path: str) -> Iterator[None]:
        """A read of ``path`` that fails on permissions or an I/O error raises
        :class:`TierUnavailableError` (tier, file, what to do); a missing file stays a builtin."""
        try:
            yield
        except OSError as exc:
            if exc.errno in _UNAVAILABLE:
                raise self._unavailable(exc, "read", path) from exc
            raise

    def stat(self, path: str) -> FileInfo:
        """``os.stat``; ``FileNotFoundError`` for a missing file or a directory, and for a path
        through a regular file (a foreign file where a checkpoint directory would be)."""
        try:
            result = os.stat(self._path(path))
        except NotADirectoryError as exc:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(self._path(path))) from exc
        if not os.path.isfile(self._path(path)):
            raise FileNotFoundError(errno.ENOENT, "not a regular file", str(self._path(path)))
        return FileInfo(path, result.st_size, result.st_mtime)

    def list_dir(self, path: str = "") -> list[str]:
        """Children of a directory, temp files hidden; [] if missing."""
        try:
            return sorted(n for n in os.listdir(self._path(path)) if not is_temporary(n))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def find(self, path: str = "", *, after: str | None = None) -> list[FileInfo]:
        """All files below ``path`` (temp files hidden), past ``after`` if given."""
        start = self._path(path)
        found: list[FileInfo] = []
        for directory, _dirs, files in os.walk(start):
            # One relative prefix per directory, not a relpath per file: a commit log of 10,000
            # entries is one directory, and relpath was most of the listing's time.
            rel_dir = os.path.relpath(directory, self.base).replace(os.sep, "/")
            prefix = "" if rel_dir == "." else f"{rel_dir}/"
            beat()  # a directory: a long walk is progress to whoever bounds it
            for name in files:
                if is_temporary(name) or (after is not None and prefix + name <= after):
                    continue  # not stat'ed: a log listed above a number skips the entries below it
                try:
                    result = os.stat(os.path.join(directory, name))
                except FileNotFoundError:
                    continue  # deleted while we walked
                found.append(FileInfo(prefix + name, result.st_size, result.st_mtime))
        return sorted(found, key=lambda f: f.path)

    def find_in_children(self, name: str, *, besides: str | None = None) -> dict[str, FileInfo]:
        """One ``scandir`` of the root, one ``stat`` per child: no walk of the data files."""
        found: dict[str, FileInfo] = {}
        try:
            entries = list(os.scandir(self.base))
        except FileNotFoundError:
            return {}
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and entry.name != besides:
                try:
                    result = os.stat(os.path.join(entry.path, name))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                found[entry.name] = FileInfo(f"{entry.name}/{name}", result.st_size, result.st_mtime)
        return found

    def incomplete_writes(self, *, idle_for: float, now: float) -> list[IncompleteWrite]:
        """Temp files of interrupted writes not written to for ``idle_for`` seconds."""
        found: list[IncompleteWrite] = []
        for directory, _dirs, files in os.walk(self.base):
            beat()
            for name in files:
                if is_temporary(name):
                    full = os.path.join(directory, name)
                    try:
                        mtime = os.stat(full).st_mtime
                    except FileNotFoundError:
                        continue
                    if now - mtime >= idle_for:
                        rel = os.path.relpath(full, self.base).replace(os.sep, "/")
                        found.append(IncompleteWrite(rel, mtime, "temporary file"))
        return found

    def delete(self, path: str) -> None:
        """Unlink one file and fsync its directory."""
        target = self._path(path)
        try:
            target.unlink()
        except FileNotFoundError:
            return
        fsync_dir(target.parent)

    def remove_if_empty(self, path: str) -> None:
        """``rmdir``: fails (and is ignored) when anything is inside."""
        target = self._path(path)
        try:
            target.rmdir()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                return
            raise
        fsync_dir(target.parent)

    def delete_tree(self, path: str) -> None:
        """Remove a directory tree (missing is fine) and fsync the parent."""
        target = self._path(path)
        try:
            shutil.rmtree(target)
        except FileNotFoundError:
            return
        fsync_dir(target.parent)


def _read_exact(f: object, length: int) -> bytes:
    chunks: list[bytes] = []
    remaining = length
    while remaining > 0:
        chunk = f.read(remaining)  # type: ignore[attr-defined]
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
