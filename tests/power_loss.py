"""A power cut at any point: record what a file tier does to the OS, then rebuild each crash state.

:class:`OsRecorder` is a fault layer around the operating system, not a patch of tierstore: while it
is active, the ``os`` functions every POSIX tier's IO goes through (``open``, ``write``, ``pwrite``,
``fsync``, ``rename``, ``replace``, ``link``, ``unlink``, ``mkdir``, ``rmdir``, ``ftruncate``;
``pathlib`` and ``shutil.rmtree`` call them too) are wrapped, and every call on a path below the
recorded root is one *operation* of the trace. The calls still happen for real; the recorder only
notes, at each ``fsync``, what that fsync made durable:

* ``fsync`` of a file: the file's whole content at that instant (read back through ``/proc``);
* ``fsync`` of a directory: its entries at that instant (name -> inode, file or directory);
* each ``write``/``pwrite``/``ftruncate`` since (with its inode, offset and bytes), for the
  prefix-of-writes variants.

The power-cut model (ext4-like, conservative). A crash after operation *i* leaves:

* every directory with the entries it had at its last ``fsync`` before *i* (or when recording
  began): names created, renamed in or unlinked since are reverted (new names dropped, old names
  back, pointing at the same inodes as then);
* every file reachable through those entries with the content of its last ``fsync`` before *i*
  (or when recording began); a file never fsynced is empty;
* as variants (:meth:`Trace.crash_states`): the unsynced changes of one directory, or of all,
  did reach the disk (names created, renamed or unlinked since its fsync); and, in the conservative
  state and the all-flushed one, one reachable file also kept the first k of the writes made to it
  since its last fsync (written-back pages that reached the disk before the cut, in write order;
  k = 1 .. all).

What the model does not cover: storage that acknowledges an ``fsync`` it did not make durable
(a lying disk cache, an NFS server without ``sync``), torn writes inside one ``write`` call,
reordering of writes within a file beyond the prefix order, a directory whose unsynced changes
reached the disk only in part, and IO not made through the ``os`` module (``mmap`` stores, the
builtin ``open``; the disk tiers use neither for what they persist). Only this process's calls
are seen: a multi-rank save's other processes are not. The root must be on tmpfs, where inode
numbers are not reused, so an inode names one file for the whole trace.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Tree = dict[str, "bytes | Tree"]
"""A directory: name -> file content, or name -> sub-directory."""
Entries = dict[str, tuple[int, bool]]
"""A directory's entries: name -> (inode, is a directory)."""

_NAME_CALLS = ("rename", "replace", "link", "unlink", "remove", "mkdir", "rmdir")
"""The ``os`` calls that change names (and only names): one wrapper serves them all."""
_WRAPPED = ("open", "write", "pwrite", "fsync", "fdatasync", "ftruncate", *_NAME_CALLS)
"""The ``os`` functions the recorder wraps: every call a POSIX tier makes to change a file."""
_UNMODELLED = {
    "writev": 0,
    "pwritev": 0,
    "sendfile": 0,
    "copy_file_range": 1,
    "truncate": 0,
    "symlink": 1,
    "posix_fallocate": 0,
}
"""Other ``os`` calls that change files, and which argument names the file changed: the model
does not know them, so one below the root fails the recording instead of going unseen."""
_TWO_PATHS = frozenset({"rename", "replace", "link"})


@dataclass(frozen=True)
class Op:
    """One recorded operation: its 1-based ``index`` in the trace, the call and the path."""

    index: int
    call: str
    path: str


@dataclass(frozen=True)
class CrashState:
    """The tree a power cut after operation ``after`` leaves; ``variant`` says which one."""

    after: int
    variant: str
    tree: Tree


@dataclass
class _Write:
    op: int
    offset: int
    data: bytes | None
    """None: a truncation to ``offset``."""


@dataclass
class Trace:
    """What :class:`OsRecorder` saw: the operations and what each ``fsync`` made durable."""

    root_inode: int
    initial_dirs: dict[int, Entries]
    initial_files: dict[int, bytes]
    ops: list[Op] = field(default_factory=list)
    file_syncs: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    dir_syncs: dict[int, list[tuple[int, Entries]]] = field(default_factory=dict)
    dir_states: dict[int, list[tuple[int, Entries]]] = field(default_factory=dict)
    """A directory's entries after each operation that changed them (synced or not)."""
    writes: dict[int, list[_Write]] = field(default_factory=dict)
    marks: list[tuple[int, str]] = field(default_factory=list)
    """``(operations done, label)``: what the test noted between operations (a save returned)."""

    def marks_before(self, after: int) -> list[str]:
        """The labels noted with no later operation than ``after`` (they happened before the cut)."""
        return [label for done, label in self.marks if done <= after]

    def crash_state(self, after: int) -> CrashState:
        """The conservative crash state after operation ``after`` (0: before the first)."""
        return CrashState(after, "reverted", self._tree(self.root_inode, after, {}, {}))

    def crash_states(self, after: int, *, flushed: bool, prefixes: bool) -> list[CrashState]:
        """The conservative crash state after ``after``, then its variants: ``flushed``, the
        unsynced changes of one directory, then of every directory, did reach the disk;
        ``prefixes``, in the conservative state and in the one with every directory flushed, one
        reachable file also kept the first k of the writes made to it since its last fsync
        (k = 1 .. all)."""
        choices: list[tuple[str, dict[int, Entries]]] = [("reverted", {})]
        if flushed:
            choices += self._flush_choices(after)
        states = []
        for number, (label, dirs) in enumerate(choices):
            states.append(CrashState(after, label, self._tree(self.root_inode, after, {}, dirs)))
            if not prefixes or 0 < number < len(choices) - 1:
                continue
            for inode in sorted(self._reachable_files(self.root_inode, after, dirs)):
                pending = self._pending_writes(inode, after)
                for count in range(1, len(pending) + 1):
                    extra = {inode: _apply(self._file(inode, after), pending[:count])}
                    tree = self._tree(self.root_inode, after, extra, dirs)
                    states.append(CrashState(after, f"{label}, inode {inode} +{count} writes", tree))
        return states

    def _flush_choices(self, after: int) -> list[tuple[str, dict[int, Entries]]]:
        """``(label, {directory: entries})`` for each directory whose entries differ from their
        last fsync, alone, then for all of them at once."""
        current = {d: e for d in self.dir_states if (e := self._current(d, after)) is not None}
        pending = {d: e for d, e in current.items() if e != self._entries(d, after)}
        choices = [(f"directory {d} flushed", {d: e}) for d, e in sorted(pending.items())]
        if len(pending) > 1:
            choices.append(("every directory flushed", pending))
        return choices

    def _current(self, inode: int, after: int) -> Entries | None:
        """The entries of directory ``inode`` as last seen at or before ``after`` (None: unseen)."""
        seen = [
            (op, e) for op, e in self.dir_syncs.get(inode, []) + self.dir_states.get(inode, []) if op <= after
        ]
        return max(seen, key=lambda s: s[0])[1] if seen else None

    def _entries(self, inode: int, after: int) -> Entries:
        synced = [e for op, e in self.dir_syncs.get(inode, []) if op <= after]
        return synced[-1] if synced else self.initial_dirs.get(inode, {})

    def _file(self, inode: int, after: int) -> bytes:
        synced = [c for op, c in self.file_syncs.get(inode, []) if op <= after]
        return synced[-1] if synced else self.initial_files.get(inode, b"")

    def _last_sync(self, inode: int, after: int) -> int:
        return max((op for op, _ in self.file_syncs.get(inode, []) if op <= after), default=0)

    def _pending_writes(self, inode: int, after: int) -> list[_Write]:
        since = self._last_sync(inode, after)
        return [w for w in self.writes.get(inode, []) if since < w.op <= after]

    def _reachable_files(self, directory: int, after: int, flushed: dict[int, Entries]) -> set[int]:
        found: set[int] = set()
        entries = flushed[directory] if directory in flushed else self._entries(directory, after)
        for child, is_dir in entries.values():
            found |= self._reachable_files(child, after, flushed) if is_dir else {child}
        return found

    def _tree(self, directory: int, after: int, extra: dict[int, bytes], flushed: dict[int, Entries]) -> Tree:
        tree: Tree = {}
        entries = flushed[directory] if directory in flushed else self._entries(directory, after)
        for name, (child, is_dir) in entries.items():
            if is_dir:
                tree[name] = self._tree(child, after, extra, flushed)
            else:
                tree[name] = extra.get(child, self._file(child, after))
        return tree


def _apply(content: bytes, writes: list[_Write]) -> bytes:
    data = bytearray(content)
    for write in writes:
        if write.data is None:
            del data[write.offset :]
            data.extend(b"\0" * (write.offset - len(data)))
            continue
        end = write.offset + len(write.data)
        data.extend(b"\0" * max(0, end - len(data)))
        data[write.offset : end] = write.data
    return bytes(data)


def tree_digest(tree: Tree) -> str:
    """A digest of names, kinds and contents: equal trees, equal digests."""
    digest = hashlib.sha256()

    def feed(node: Tree, prefix: str) -> None:
        for name in sorted(node):
            value = node[name]
            if isinstance(value, dict):
                digest.update(f"d {prefix}{name}\n".encode())
                feed(value, f"{prefix}{name}/")
            else:
                digest.update(f"f {prefix}{name} {len(value)}\n".encode())
                digest.update(hashlib.sha256(value).digest())

    feed(tree, "")
    return digest.hexdigest()


def materialise(tree: Tree, destination: Path) -> None:
    """Write ``tree`` below ``destination`` (created)."""
    destination.mkdir(parents=True, exist_ok=True)
    for name, value in tree.items():
        if isinstance(value, dict):
            materialise(value, destination / name)
        else:
            (destination / name).write_bytes(value)


@contextlib.contextmanager
def tmpfs_dir(prefix: str) -> Iterator[Path]:
    """A new directory on tmpfs (``/dev/shm``, where the recorder may record), removed after."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _snapshot(root: Path) -> tuple[dict[int, Entries], dict[int, bytes]]:
    """Every directory's entries and every file's content below ``root`` (all taken as durable)."""
    dirs: dict[int, Entries] = {}
    files: dict[int, bytes] = {}
    for directory, _subdirs, names in os.walk(root):
        entries: Entries = {}
        with os.scandir(directory) as scan:
            for entry in scan:
                info = entry.stat(follow_symlinks=False)
                entries[entry.name] = (info.st_ino, stat.S_ISDIR(info.st_mode))
        dirs[os.stat(directory).st_ino] = entries
        for name in names:
            path = os.path.join(directory, name)
            files[os.stat(path).st_ino] = Path(path).read_bytes()
    return dirs, files


class OsRecorder:
    """Records every ``os`` call on paths below ``root`` while active (see the module docstring).

    Calls are serialised by one lock, so the trace is the order in which they took effect.
    """

    def __init__(self, root: Path) -> None:
        if not _on_tmpfs(root):
            raise RuntimeError(f"{root}: the recorder needs tmpfs (inode numbers never reused)")
        self.root = os.path.realpath(root)
        dirs, files = _snapshot(Path(self.root))
        self.trace = Trace(os.stat(self.root).st_ino, dirs, files)
        self._lock = threading.RLock()
        self._real: dict[str, Callable[..., Any]] = {}

    def mark(self, label: str) -> None:
        """Note ``label`` as happening after every operation recorded so far."""
        with self._lock:
            self.trace.marks.append((len(self.trace.ops), label))

    @contextlib.contextmanager
    def active(self) -> Iterator[Trace]:
        """Wrap the ``os`` functions for the duration of the block."""
        self._real = {name: getattr(os, name) for name in _WRAPPED}
        wrappers = {
            name: functools.partial(self._path_call, name)
            if name in _NAME_CALLS
            else getattr(self, f"_{name}")
            for name in _WRAPPED
        }
        for name, where in _UNMODELLED.items():
            if hasattr(os, name):
                self._real[name] = getattr(os, name)
                wrappers[name] = functools.partial(self._unmodelled, name, where)
        for name, wrapper in wrappers.items():
            setattr(os, name, wrapper)
        try:
            yield self.trace
        finally:
            for name, real in self._real.items():
                setattr(os, name, real)

    def _unmodelled(self, name: str, where: int, *args: Any, **kwargs: Any) -> Any:
        if len(args) > where and self._below(args[where]) is not None:
            raise AssertionError(
                f"os.{name} on {args[where]!r}: the power-loss model does not know this call;"
                " teach tests/power_loss.py what it makes durable"
            )
        return self._real[name](*args, **kwargs)

    # -- where a call lands ----------------------------------------------------------------------

    def _below(self, path: Any, dir_fd: int | None = None) -> str | None:
        """The root-relative path of ``path`` (``dir_fd``-relative if given), None if outside."""
        if isinstance(path, int):
            return self._fd_path(path)
        text = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(text):
            base = self._fd_path(dir_fd)
            return None if base is None else os.path.normpath(os.path.join(base, text))
        full = os.path.abspath(text)
        if full == self.root or full.startswith(self.root + os.sep):
            return os.path.relpath(full, self.root)
        return None

    def _fd_path(self, fd: int) -> str | None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        except OSError:
            return None
        if target == self.root or target.startswith(self.root + os.sep):
            return os.path.relpath(target, self.root)
        return None

    def _op(self, call: str, path: str) -> int:
        op = Op(len(self.trace.ops) + 1, call, path)
        self.trace.ops.append(op)
        return op.index

    def _path_call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """A call that changes names: record it if any path it names is below the root."""
        two = name in _TWO_PATHS
        dir_fds = [kwargs.get("src_dir_fd" if two else "dir_fd"), kwargs.get("dst_dir_fd")]
        paths = [self._below(p, fd) for p, fd in zip(args[: 2 if two else 1], dir_fds, strict=False)]
        with self._lock:
            result = self._real[name](*args, **kwargs)
            where = [p for p in paths if p is not None]
            if where:
                index = self._op(name, " -> ".join(where))
                self._note_parents(index, where)
            return result

    def _note_parents(self, index: int, where: list[str]) -> None:
        """Note the entries of the directories holding ``where`` after operation ``index``."""
        for path in where:
            parent = os.path.join(self.root, os.path.dirname(path))
            try:
                fd = self._real["open"](parent, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue  # removed with its parent (rmtree): its parent was noted then
            try:
                entries = _entries(fd)
                inode = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            self.trace.dir_states.setdefault(inode, []).append((index, entries))

    # -- the wrapped calls -----------------------------------------------------------------------

    def _open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        where = self._below(path, kwargs.get("dir_fd"))
        with self._lock:
            fd = self._real["open"](path, flags, *args, **kwargs)
            if where is not None and flags & os.O_CREAT:
                self._note_parents(self._op("open(O_CREAT)", where), [where])
            if where is not None and flags & os.O_TRUNC:
                self._record_write(fd, "open(O_TRUNC)", 0, None)
            return int(fd)

    def _write(self, fd: int, data: Any) -> int:
        with self._lock:
            offset = self._offset(fd) if self._fd_path(fd) is not None else -1
            written = int(self._real["write"](fd, data))
            if offset >= 0:
                self._record_write(fd, "write", offset, bytes(memoryview(data)[:written]))
            return written

    @staticmethod
    def _offset(fd: int) -> int:
        """Where a ``write`` to ``fd`` lands: its end when opened with ``O_APPEND``."""
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return os.fstat(fd).st_size
        return os.lseek(fd, 0, os.SEEK_CUR)

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self._lock:
            written = int(self._real["pwrite"](fd, data, offset))
            if self._fd_path(fd) is not None:
                self._record_write(fd, "pwrite", offset, bytes(memoryview(data)[:written]))
            return written

    def _ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._real["ftruncate"](fd, length)
            if self._fd_path(fd) is not None:
                self._record_write(fd, "ftruncate", length, None)

    def _record_write(self, fd: int, call: str, offset: int, data: bytes | None) -> None:
        where = self._fd_path(fd)
        if where is None:
            return
        index = self._op(call, where)
        inode = os.fstat(fd).st_ino
        self.trace.writes.setdefault(inode, []).append(_Write(index, offset, data))

    def _fsync(self, fd: int) -> None:
        self._sync("fsync", fd)

    def _fdatasync(self, fd: int) -> None:
        self._sync("fdatasync", fd)

    def _sync(self, name: str, fd: int) -> None:
        with self._lock:
            self._real[name](fd)
            where = self._fd_path(fd)
            if where is None:
                return
            index = self._op(name, where)
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                self.trace.dir_syncs.setdefault(info.st_ino, []).append((index, _entries(fd)))
            else:
                content = Path(f"/proc/self/fd/{fd}").read_bytes()
                self.trace.file_syncs.setdefault(info.st_ino, []).append((index, content))


def _entries(fd: int) -> Entries:
    """The entries of the open directory ``fd`` now."""
    entries: Entries = {}
    for name in os.listdir(fd):
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:  # pragma: no cover - calls are serialised; kept for safety
            continue
        entries[name] = (info.st_ino, stat.S_ISDIR(info.st_mode))
    return entries


def _on_tmpfs(path: Path) -> bool:
    """Whether ``path`` is on a tmpfs mount (by /proc/self/mounts, longest mount point first)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fields[2]
    return kind == "tmpfs"


__all__ = ["CrashState", "Op", "OsRecorder", "Trace", "materialise", "tree_digest"]
