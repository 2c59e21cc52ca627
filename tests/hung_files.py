"""Files that hang their reader, as a file on a hung mount does, and tiers nobody answers for."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def fifo_at(path: Path) -> Iterator[None]:
    """``path`` becomes a FIFO: opening it to read blocks. Released at the end (a writer opens and
    closes it), so no reading thread stays blocked after the test."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def refusing_s3_tier(name: str = "s3") -> dict[str, Any]:
    """An s3 tier's YAML entry whose endpoint is a loopback port nobody listens on: every request
    is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    return {
        "name": name,
        "type": "s3",
        "url": "s3://away/ckpt",
        "max_attempts": 2,
        "endpoint_url": f"http://127.0.0.1:{closed}",
    }


@functools.cache
def hung_mount_unavailable() -> str | None:
    """Why this machine cannot mount a filesystem that never answers (None: it can): tried once,
    on a scratch directory (root and ``/dev/fuse`` are not enough in a container without
    CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return "mounting a FUSE filesystem needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    with tempfile.TemporaryDirectory() as scratch:
        try:
            with hung_mount(Path(scratch)):
                pass
        except OSError as exc:
            return f"cannot mount a FUSE filesystem here: {exc}"
    return None


@contextlib.contextmanager
def hung_mount(directory: Path) -> Iterator[None]:
    """``directory`` becomes the mount point of a FUSE filesystem whose daemon never answers, not
    even its INIT: every ``stat``, ``open`` or ``mkdir`` under it blocks in the kernel, as on a
    Lustre or NFS hard mount whose server went away. At the end the connection is aborted (the
    blocked calls fail with ENOTCONN) and the mount detached."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"tierstore-hung", str(directory).encode(), b"fuse.tierstore-hung", 0, options) != 0:
        error = ctypes.get_errno()
        os.close(fd)
        raise OSError(error, f"mount {directory}: {os.strerror(error)}")
    try:
        yield
    finally:
        os.close(fd)
        libc.umount2(str(directory).encode(), 2)  # MNT_DETACH
