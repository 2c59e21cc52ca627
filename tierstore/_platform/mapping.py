"""File mappings made through libc: populated in one call, kept by no descriptor, never inherited.

The peer mirror hands gloo memory-mapped files (a sender's own checkpoint file, a receiver's spare
landing file). Two properties :class:`mmap.mmap` cannot give matter there:

* **No descriptor and no inheritance.** :class:`mmap.mmap` keeps a duplicate of the file's
  descriptor for the mapping's life (before Python 3.13's ``trackfd``), and a forked child (a
  training process forks DataLoader workers) inherits both the mapping and the descriptor: it would
  hold a removed file's tmpfs pages for its own life. Here the descriptor is the caller's (opened
  with :func:`~tierstore._platform.forks.open_unshared` and closed at once), and the range is
  ``MADV_DONTFORK`` before any fork can see it.
* **Page tables filled in one call**, not one fault per page on gloo's thread: 256 MiB of a tmpfs
  file is 65,536 pages (a spare's all at once, between rounds; a sent file's a message ahead of
  gloo, :func:`populate_for_reading`).

A shared mapping is a ctypes array over the mapped range (what :func:`torch.frombuffer` takes),
unmapped by :meth:`Mapping.close`, else when the last reference to it goes (a tensor made of it
holds one); a private one is a view of such an array.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import Protocol, cast

from tierstore._platform.forks import no_fork

_MADV_POPULATE_READ = 22  # Linux >= 5.14: map every page in, for reading, with one call
_MADV_POPULATE_WRITE = 23  # the same, for writing (no page is copied in a shared mapping)
_MAP_FAILED = ctypes.c_void_p(-1).value
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TMPFS_MAGIC = 0x01021994


class Mapping(Protocol):
    """A mapped range of a file, as a buffer; see the module docstring."""

    def __len__(self) -> int: ...

    def close(self) -> None:
        """Unmap now (the caller is sure no tensor or view made of it is still in use)."""


def map_shared(fd: int, size: int) -> Mapping:
    """Map ``size`` bytes of ``fd`` writable and shared (a write reaches the file), every page
    present where the kernel can (``MADV_POPULATE_WRITE``: for a shared mapping, the file's own
    pages, no copy). ``OSError`` on failure."""
    mapping = _map(fd, size, mmap.MAP_SHARED)
    # After the mapping is made, not by MAP_POPULATE within it: forks wait only for the mmap.
    _libc().madvise(ctypes.c_void_p(ctypes.addressof(mapping)), ctypes.c_size_t(size), _MADV_POPULATE_WRITE)
    return cast(Mapping, mapping)


def map_private(fd: int, size: int) -> memoryview:
    """Map ``size`` bytes of ``fd`` private and copy-on-write (a write changes the mapping's own
    copy of a page, never the file). The bytes, as a view: unmapped when the last view or tensor
    made of it goes. Pages are mapped as they are first read, or ahead of that by
    :func:`populate_for_reading`. ``OSError`` on failure."""
    return memoryview(_map(fd, size, mmap.MAP_PRIVATE)).cast("B")


def populate_for_reading(address: int, length: int) -> None:
    """Fill the page tables of the ``length`` bytes mapped at ``address`` with one call
    (``MADV_POPULATE_READ``: a file's pages themselves, read-only until written), so that reading
    them faults no more. Best effort: a kernel without it (before 5.14), or memory that is not a
    mapping, leaves them to fault in as they are read."""
    start = address - address % _PAGE
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), _MADV_POPULATE_READ)


def is_tmpfs(directory: str) -> bool:
    """Whether ``directory`` is on a tmpfs (``statfs``'s ``f_type``: the first field, a C long,
    on Linux). False where it cannot be told."""
    try:
        libc = _libc()
        buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.statfs(os.fsencode(directory), buffer) != 0:
            return False
        return ctypes.c_long.from_buffer(buffer).value == _TMPFS_MAGIC
    except (OSError, AttributeError, TypeError):
        return False


def _map(fd: int, size: int, flags: int) -> ctypes.Array[ctypes.c_char]:
    libc = _libc()
    with no_fork():  # a child forked between the mmap and the madvise would inherit the mapping
        address = libc.mmap(
            None, ctypes.c_size_t(size), mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, ctypes.c_long(0)
        )
        if address is None or address == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap: {os.strerror(ctypes.get_errno())}")
        if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), mmap.MADV_DONTFORK) != 0:
            error = ctypes.get_errno()
            libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
            raise OSError(error, f"madvise: {os.strerror(error)}")
    kind: type[ctypes.Array[ctypes.c_char]] = type(
        "Mapping", (ctypes.c_char * size,), {"close": _unmap, "__del__": _unmap}
    )
    return kind.from_address(address)


def _unmap(mapping: ctypes.Array[ctypes.c_char]) -> None:
    if not getattr(mapping, "unmapped", False):
        mapping.unmapped = True  # type: ignore[attr-defined]
        _libc().munmap(ctypes.c_void_p(ctypes.addressof(mapping)), ctypes.c_size_t(len(mapping)))


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols: libc's
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return libc
