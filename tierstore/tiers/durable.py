"""The durable-write recipe for POSIX directories: temp file, ``fsync``, rename, ``fsync`` the directory.

Every name this module creates is durable before the call returns: file contents are fsynced before a
name points at them, and a new, renamed or removed name is made durable by fsyncing its directory
(directories created on the way are made durable in their parents the same way). An fsync error is
never retried and trusted: the write fails, and a new name whose directory fsync failed is removed
again (:func:`withdraw_name`) before the error reaches the caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
TEMP_MARK = ".tmp-"
"""Temporary files are named ``.<name>.tmp-<random>``; listings hide them, cleanup removes idle ones."""


def is_temporary(name: str) -> bool:
    """True for the hidden temporary names written before a rename."""
    return name.startswith(".") and TEMP_MARK in name


def temp_name_for(target: Path, token: str) -> Path:
    """The hidden temporary file beside ``target``."""
    return target.with_name(f".{target.name}{TEMP_MARK}{token}")


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the entries of ``directory`` (new, renamed or removed names) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def withdraw_name(path: Path, inode: int) -> None:
    """Remove ``path`` if it still names the file ``inode``: a name just created whose directory
    fsync failed. The caller reports the write as failed, so nothing may stay visible under it."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def make_dirs_durable(directory: Path) -> None:
    """``mkdir -p`` where every directory created is made durable in its parent."""
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            continue
        fsync_dir(path.parent)


def in_dirs(directory: Path, create: Callable[[], T], *, tries: int = 5) -> T:
    """``create()`` (a new name in ``directory``) once :func:`make_dirs_durable` made the directory;
    both again when it fails because a directory of the chain vanished in between.

    Directories are not forever: a reader removes again, once empty, those its ``read`` record made
    (:mod:`tierstore.records.activity`), and another process's first file may be on its way into
    one just then. A missing name while ``directory`` still exists is the caller's error (a source
    that is gone): raised at once. Each remover acts once, so a few tries are enough.
    """
    attempt = 1
    while True:
        try:
            make_dirs_durable(directory)
            return create()
        except FileNotFoundError:
            if attempt >= tries or directory.exists():
                raise
            attempt += 1


class FdStream:
    """Write-only stream over a raw file descriptor (no Python buffering, no extra copy)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        """Write all of ``data``."""
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
        self.size += total
        return total
