"""Who owns a staging directory, and whether that owner is still alive.

A writer process's staging directory is named ``<host>~<pid>~<random>`` (for people) and holds
``owner.lock``, on which the writer keeps an exclusive ``flock`` for as long as it lives. The kernel
drops the lock when the process dies, however it dies. Cleanup asks the lock, not the pid: a sidecar
in another PID namespace (a separate container) cannot see the writer's pid, but it shares the
tmpfs, and the lock answers the same there. Directories of writers from before the lock existed fall
back to the pid (same host only) and their age.

A ``flock`` belongs to the open file, which a forked child shares: a child that kept its copy (a
data-loader worker, a helper the trainer forked) would keep a SIGKILLed owner's directory locked for
as long as it lives. So a forked child closes its copies at once (:class:`_HeldLocks`); that
releases nothing while the owner holds its own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
import uuid

from tierstore._platform.runtime import track

LOCK_NAME = "owner.lock"


class _HeldLocks:
    """This process's owner locks, each as its descriptor and its lock file's identity."""

    def __init__(self) -> None:
        self._held: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()
        track(self)

    def add(self, fd: int) -> None:
        """Note the lock descriptor ``fd`` (forgetting those closed since)."""
        with self._lock:
            self._held = [entry for entry in self._held if _still(*entry)]
            stat = os.fstat(fd)
            self._held.append((fd, stat.st_dev, stat.st_ino))

    def _forget_in_child(self) -> None:
        self._lock = threading.Lock()
        for fd, device, inode in self._held:
            # Only a descriptor that is still that lock file: the parent may have closed it, and
            # its number may name another file now.
            if _still(fd, device, inode):
                os.close(fd)
        self._held = []


def _still(fd: int, device: int, inode: int) -> bool:
    """Whether ``fd`` is still the lock file it was: the same file, and (where ``/proc`` says) a
    lock file by name, since a closed lock's inode number may be another file's by now."""
    try:
        stat = os.fstat(fd)
    except OSError:
        return False
    if (stat.st_dev, stat.st_ino) != (device, inode):
        return False
    try:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return True  # no /proc: the file's identity has to do
    return name.removesuffix(" (deleted)") == LOCK_NAME


_HELD = _HeldLocks()


def owner_dir_name() -> str:
    """``<host>~<pid>~<random>``: whose staging files these are."""
    return f"{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"


def hold_owner_lock(directory: str) -> int:
    """Create ``directory`` if needed and lock its ``owner.lock`` for this process's lifetime.

    Returns the descriptor; keep it open (closing it releases the lock). A forked child does not
    inherit it (see the module docstring).
    """
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    _HELD.add(fd)
    return fd


def owner_is_alive(directory: str) -> bool | None:
    """True while the directory's owner holds its lock, False once it is gone, None when the
    directory has no lock file (a writer from before the lock existed: see :func:`owner_is_gone`)."""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # also releases the probe's lock at once
    return False


def owner_is_gone(name: str) -> bool:
    """For a directory without a lock: True when its owner's pid no longer runs on this host."""
    parts = name.split("~")
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False  # another host's, or not ours to judge
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


__all__ = ["hold_owner_lock", "owner_dir_name", "owner_is_alive", "owner_is_gone"]
