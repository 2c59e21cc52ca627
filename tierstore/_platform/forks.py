"""Descriptors and mappings that a forked child must not keep.

A trainer forks (DataLoader workers, at every epoch) while the peer mirror works on another thread:
a child that inherits a descriptor of a mirror file, or a mapping of it, holds the file's tmpfs pages
(host memory) after retention removes it, for the child's whole life. Python's descriptors are
closed by ``exec``, not by ``fork``, and Linux has no close-on-fork flag, so:

* :func:`open_unshared` opens a file whose descriptor every forked child closes at once (the
  runtime's fork hook calls :func:`after_fork_in_child`), and :func:`close_unshared` closes it here;
* :func:`no_fork` holds forks back for a few steps that must not be split by one (a mapping made and
  marked ``MADV_DONTFORK``).

Forks wait, at most, for an ``open``, ``mmap``, ``madvise`` or ``close`` on another thread (each a
system call on a local filesystem); never for a descriptor's whole use.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_guard = threading.RLock()
"""Reentrant: a garbage collection inside a guarded step may run a finalizer that closes one."""
_unshared: set[int] = set()


def open_unshared(path: str, flags: int, mode: int = 0o644) -> int:
    """:func:`os.open`, but a child forked while the descriptor is open closes its copy at once.
    Close it with :func:`close_unshared`."""
    with _guard:  # a fork between the open and the bookkeeping would miss the descriptor
        fd = os.open(path, flags, mode)
        _unshared.add(fd)
    return fd


def close_unshared(fd: int) -> None:
    """Close a descriptor :func:`open_unshared` returned."""
    with _guard:  # a fork in between would close a number this process reuses meanwhile
        _unshared.discard(fd)
        os.close(fd)


@contextlib.contextmanager
def no_fork() -> Iterator[None]:
    """Hold forks (by any other thread of this process) back while the block runs: keep it to a
    few system calls, and never fork inside it (that fork would split the step)."""
    with _guard:
        yield


def before_fork() -> None:
    """The runtime's fork hook, in the forking thread: wait for any guarded step to end."""
    _guard.acquire()


def after_fork_in_parent() -> None:
    """The runtime's fork hook, in the parent once forked."""
    _guard.release()


def after_fork_in_child() -> None:
    """The runtime's fork hook, first thing in the child: close every unshared descriptor."""
    for fd in _unshared:
        with contextlib.suppress(OSError):
            os.close(fd)
    _unshared.clear()
    _guard.release()
