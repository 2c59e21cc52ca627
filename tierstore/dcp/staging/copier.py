"""The copy into a slab: glibc's ``memmove`` in chunks, taken by several threads as each comes free.

Measured on 2 cores, 1 GiB in 186 tensors into a warm tmpfs slab, side by side with torch's ``copy_``
(what torch's stagers do): 0.091-0.098 s against 0.100-0.105 s when the copy runs alone, and 0.138 s
against 0.26-0.27 s while another process copies memory (a previous checkpoint's promotion). torch
splits each tensor's copy evenly between its threads, so the copy lasts as long as the thread that
shares its core with the other process; here a thread takes the next chunk when it is free, so the
copy goes at the speed of the CPU time it actually gets.

Whether a chunk is written with non-temporal stores (the destination not read into the cache
first, the trainer's working set left there) is glibc's choice: above its
``x86_non_temporal_threshold`` (derived from the last-level cache's share per thread, often a
few MiB), else ``rep movsb``. A 2-vCPU VM that reports a large L3 gets a large threshold
(190 MiB on the one of 2026-12-07, L3 reported as 480 MiB): there every chunk takes the cached
path, measured 1.4-1.6x slower than non-temporal stores (256 MiB on one thread, 512 MiB on two).
``ld.so --list-tunables`` shows the threshold;
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x400000`` in the trainer's environment
lowers it for the whole process.

Fresh pages are another matter: the page faults dominate, and torch's copy into fresh memory was the
faster one (0.27 s against 0.30-0.34 s), so a first save keeps torch's way: allocate every
buffer, then ``copy_`` (see :mod:`staging`).
The number of threads is ``torch.get_num_threads()`` (``OMP_NUM_THREADS`` under torchrun): no more
cores than torch's own copy would take.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from tierstore._platform.runtime import ProcessLocal, SerialWorker

CHUNK = 8 * 2**20
"""Bytes per ``memmove``: small enough to balance the threads, large enough for a negligible
per-call cost (and for non-temporal stores where glibc's threshold is below it)."""
MAX_THREADS = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memmove.restype = ctypes.c_void_p

_Chunk = tuple[int, int, int]


def can_move(destination: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``source``'s bytes may be copied into ``destination`` as plain memory.

    Both plain, contiguous CPU tensors of one dtype and shape, with no lazy conjugate or negative
    bit, the source backed by memory; anything else (a tensor subclass, a strided view, a
    ``ZeroTensor``) is left to ``copy_``.
    """
    return (
        type(source) is torch.Tensor
        and not source._is_zerotensor()  # no memory behind it: data_ptr() is 0
        and (source.data_ptr() != 0 or source.numel() == 0)
        and source.device.type == "cpu"
        and destination.device.type == "cpu"
        and source.dtype == destination.dtype
        and source.shape == destination.shape
        and source.is_contiguous()
        and destination.is_contiguous()
        and not source.is_conj()
        and not source.is_neg()
    )


def _chunks(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[_Chunk]:
    chunks: list[_Chunk] = []
    for destination, source in pairs:
        to, start = destination.data_ptr(), source.data_ptr()
        nbytes = source.numel() * source.element_size()
        chunks.extend((to + at, start + at, min(CHUNK, nbytes - at)) for at in range(0, nbytes, CHUNK))
    return chunks


def _move_all(chunks: Iterator[_Chunk]) -> None:
    # Each call lets go of the GIL (ctypes), so the threads copy side by side; taking the next
    # chunk from the shared iterator is atomic under the GIL.
    for to, start, nbytes in chunks:
        _libc.memmove(to, start, nbytes)


class _Helpers:
    """This process's copy helpers: one serial worker per extra thread, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: list[SerialWorker] = []

    def run(self, job: Callable[[], None], helpers: int) -> list[Future[None]]:
        """Start ``job`` on ``helpers`` threads; returns a future per thread."""
        with self._lock:
            while len(self._workers) < helpers:
                self._workers.append(SerialWorker("tierstore-copy"))
            workers = self._workers[:helpers]
        return [worker.submit(job) for worker in workers]


_HELPERS = ProcessLocal(_Helpers)
"""This process's helpers (a forked child starts its own: the parent's threads are not there)."""


def move(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(destination, source)`` pair (see :func:`can_move`); returns when all are done.

    The caller's thread copies too; helpers are only woken for more than one chunk.
    """
    chunks = _chunks(pairs)
    threads = max(1, min(torch.get_num_threads(), MAX_THREADS, len(chunks)))
    shared = iter(chunks)
    done = _HELPERS.get().run(lambda: _move_all(shared), threads - 1) if threads > 1 else []
    _move_all(shared)
    for helper in done:
        helper.result()
