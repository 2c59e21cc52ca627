"""Staging for ``dcp.async_save``: one copy of the state into reusable host buffers, nothing else.

``TieredWriter.stage()`` (DCP's ``AsyncStager``) runs on the trainer's thread: it lays the state's tensors
out in one buffer (64-byte aligned, after a 64-byte header), copies them in, and returns a state dict of
views into that buffer. The trainer may change its tensors as soon as ``async_save`` returns. With
``overlap=True`` the same copy runs on a background thread instead (:mod:`tierstore.dcp.staging.overlap`).

The buffer is a *slab*:

* when the target tier is a ``memory`` tier, a file in that tier's tmpfs
  (``.tierstore/staging/<owner>/slab-*.bin``) mapped into the process: the background save only
  checksums it and renames it into the checkpoint, so staging *is* the first tier's write. Since the
  slab becomes the checkpoint's data file, the next save needs another one: a *spare* is prepared (its
  pages allocated and mapped) in a background thread once the save has been handed to DCP's thread
  (not during the stall, where it would contend for the CPU and the GIL), so the next stage copies into
  warm memory;
* otherwise, anonymous shared memory, reused save after save.

**The first save** into a memory tier (or the first after the state changed size, with no spare of that
size ready) has no slab to copy into. It copies each tensor into fresh process memory instead, as
torch's own stager does, and its background save writes those copies into the tier like a plain
``dcp.save``; they are freed with the save. Fresh tmpfs pages cost about 1.4x as much to fault in as
fresh private ones, and a first copy touches every page: this keeps the first stall at the cost of
torch's first save. After the handover, the spare is prepared if the tier has room for the checkpoint
and a spare (otherwise the checkpoint comes first and the next save allocates on its own), so later
saves are the zero-copy kind. In PROCESS mode torch moves the copies into shared memory on DCP's
thread (a copy off the stall, and one more state's worth of ``/dev/shm`` while that save runs). Not
with CUDA: the device-to-host copy needs the page-locked slab. ``prepare()`` removes even the first
fault cost.

**Memory bound.** At most two slabs per rank exist at once: the one being persisted (for a memory tier it
then *is* the checkpoint, counted by the tier's ``keep``) and the spare. **Back-pressure.** A save that
starts while the previous save from the same writer is still persisting waits for it (the buffer, and
DCP's writer object, are not shared between saves in flight); the wait is logged and recorded as
``wait_s`` in the marker, and is part of the stall. When a save is over is decided in
:mod:`tierstore.dcp.staging.pending`.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tierstore._platform.owners import LOCK_NAME
from tierstore._platform.runtime import ProcessLocal, SerialWorker, finalize
from tierstore.dcp.layout import ALIGN, HEADER_SIZE, MAGIC, STAGE_TOKEN, view_of
from tierstore.dcp.staging import slab_use
from tierstore.dcp.staging.copier import can_move, move
from tierstore.dcp.staging.now import STAGING_NOW
from tierstore.dcp.staging.overlap import StagingFuture, StagingQueue
from tierstore.dcp.staging.pending import Pending
from tierstore.dcp.staging.staged_shard import StagedShard
from tierstore.errors import TierUnavailableError
from tierstore.tiers import OwnedDirectory

logger = logging.getLogger(__name__)
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault every page in with one call
_PAGE = os.sysconf("SC_PAGE_SIZE")
_ROOM = 64 * 2**20
"""Free space, beyond twice a slab, below which slabs are allocated up front (see ``_tight``)."""
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclass(frozen=True)
class SlabInfo:
    """What the background save needs to know about the slab it was handed."""

    nbytes: int
    token: bytes
    path: str | None
    """The slab's file in the memory tier (None for anonymous shared memory)."""


@dataclass(frozen=True)
class StagedSave:
    """A finished copy: what the writer that carries the save needs from staging."""

    state: Any
    """The staged state: views into the slab (or fresh tensors), isolated from the trainer's."""
    slab: SlabInfo | None
    """The slab it was copied into; None when it was copied into fresh memory."""
    waited: float
    """Seconds the copy waited (the previous save's back-pressure, a spare being prepared)."""
    pending: Pending
    """The save, until it is over (its carrier reports in through this)."""


class Slab:
    """One staging buffer: shared memory (a tmpfs file or anonymous), optionally page-locked."""

    def __init__(self, nbytes: int, path: str | None, *, preallocate: bool = False) -> None:
        self.nbytes = nbytes
        self.path = path
        # torch's shared-memory storages (private API, pinned by tests/test_torch_contract.py) are
        # passed to DCP's checkpoint process by file descriptor: no copy in PROCESS mode.
        storage_class: Any = torch.UntypedStorage
        if path is None:
            self.storage: torch.UntypedStorage = storage_class._new_shared(nbytes)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                # In the background, allocate the pages now: a full tmpfs then fails here with
                # ENOSPC, not later with SIGBUS on first touch. On the trainer's thread the copy
                # itself faults the pages in, which is cheaper.
                if preallocate:
                    os.posix_fallocate(fd, 0, nbytes)
                else:
                    os.ftruncate(fd, nbytes)
                self.storage = storage_class._new_shared_fd_cpu(fd, nbytes)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a full tier keeps no empty slab file
                raise
            finally:
                os.close(fd)  # the storage keeps its own duplicate
        self.use = slab_use.register(self.storage)
        """Who reads or stages into this slab now (see :mod:`tierstore.dcp.staging.slab_use`)."""
        self.pinned = False
        if torch.cuda.is_available():
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            self.pinned = int(cudart.cudaHostRegister(self.storage.data_ptr(), nbytes, 0)) == 0

    def populate(self) -> None:
        """Map every page now (so that the copy into it does not fault page by page)."""
        if _libc.madvise(self.storage.data_ptr(), self.nbytes, _MADV_POPULATE_WRITE) != 0:
            view = view_of(self.storage, 0, torch.uint8, (self.nbytes,))
            view[::_PAGE].zero_()  # older kernels: touch one byte per page

    def drop_pages(self) -> None:
        """Unmap the slab's pages without holding the GIL (ahead of dropping the slab); they stay
        in its tmpfs file or shared memory."""
        _libc.madvise(self.storage.data_ptr(), self.nbytes, _MADV_DONTNEED)

    @property
    def consumed(self) -> bool:
        """True when a save renamed this slab into a checkpoint: it must never be written again."""
        return self.path is not None and not os.path.exists(self.path)

    def tensor(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A view of the slab at byte ``offset`` with ``like``'s dtype and shape (contiguous)."""
        return view_of(self.storage, offset, like.dtype, tuple(like.shape))

    def release(self) -> None:
        """Unpin and, if this slab never became a checkpoint, remove its file."""
        slab_use.unregister(self.storage, self.use)
        if self.pinned:
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self.storage.data_ptr())
            self.pinned = False
        if self.path is not None and not self.consumed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _tight(directory: str, nbytes: int) -> bool:
    """Whether a slab of ``nbytes`` must be allocated up front in ``directory`` (a tmpfs).

    A slab is a sparse file whose pages the copy faults in: if the tmpfs runs out under the copy,
    the process dies of SIGBUS. So: not enough room at all is a clear error now; little room to
    spare (another writer could take it) means allocating every page first, where a shortfall is a
    clean ENOSPC; plenty of room keeps the cheaper path.
    """
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise TierUnavailableError(
            f"{directory}: a staging buffer needs {nbytes} bytes, the memory tier has {free} free"
            " (size host memory for keep x checkpoint + staging: see docs/configuration.md)"
        )
    return free < 2 * nbytes + _ROOM


def _walk(value: Any, on_tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild a nested state (dicts, lists, tuples) with tensors mapped and other leaves copied.

    A DTensor becomes a :class:`StagedShard` of its mapped local tensor: a DTensor around the
    staging buffer would crash DCP's PROCESS mode (see :mod:`tierstore.dcp.staging.staged_shard`).
    """
    if isinstance(value, DTensor):
        return StagedShard.of(on_tensor(value.to_local()), value)
    if isinstance(value, torch.Tensor):
        return on_tensor(value)
    if isinstance(value, dict):
        return type(value)((k, _walk(v, on_tensor)) for k, v in value.items())
    if isinstance(value, list):
        return [_walk(v, on_tensor) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_walk(v, on_tensor) for v in value)
    return copy.deepcopy(value)  # isolation: the trainer may mutate it after async_save returns


def _copy_into_fresh_memory(state: Any, made: list[torch.Tensor]) -> Any:
    """A first save's copy: every buffer allocated first, then every tensor copied, as torch's
    stager does. Cloning tensor by tensor (allocate, copy, allocate...) was 2-3 % slower in fresh
    processes (1 GiB, 186 tensors: 0.33-0.37 s against 0.30-0.35 s). Appends each copy to ``made``."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocate(tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        if not _stageable(source):
            made.append(source.clone())  # sparse, quantized, nested: their own copy
            return made[-1]
        target = torch.empty_like(source)
        copies.append((target, source))
        made.append(target)
        return target

    staged = _walk(state, allocate)
    for target, source in copies:
        target.copy_(source)
    return staged


def _layout(state: Any) -> tuple[list[int | None], int]:
    """Byte offsets of the state's tensors in a slab (None: not staged), in traversal order."""
    offsets: list[int | None] = []
    offset = HEADER_SIZE

    def plan(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        if not _stageable(tensor):
            offsets.append(None)
            return tensor
        offsets.append(offset)
        offset = -(-(offset + tensor.numel() * tensor.element_size()) // ALIGN) * ALIGN
        return tensor

    _walk(state, plan)
    return offsets, max(offset, HEADER_SIZE)


def _stageable(tensor: torch.Tensor) -> bool:
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type in ("cpu", "cuda")
    )


def _remove_directory(directory: str | None, lock_fd: int | None) -> None:
    """At exit: drop the files of slabs that never became checkpoints (a spare, an unused slab),
    then the owner lock (unlinked before it is released, so no cleanup can see it unlocked)."""
    if directory is not None:
        for entry in Path(directory).glob("slab-*.bin"):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
        with contextlib.suppress(FileNotFoundError):
            (Path(directory) / LOCK_NAME).unlink()
        with contextlib.suppress(OSError):
            Path(directory).rmdir()
    if lock_fd is not None:
        os.close(lock_fd)


def _copy_into_slab(
    slab: Slab, state: Any, offsets: list[int | None], made: list[torch.Tensor]
) -> tuple[Any, bytes]:
    """Write a new stage's header into ``slab``, copy ``state`` in; the staged state and token."""
    token = uuid.uuid4().bytes
    header = torch.frombuffer(bytearray(MAGIC + token), dtype=torch.uint8)
    view_of(slab.storage, 0, torch.uint8, (len(header),)).copy_(header)
    position = iter(offsets)
    devices: set[torch.device] = set()
    moves: list[tuple[torch.Tensor, torch.Tensor]] = []

    def place(tensor: torch.Tensor) -> torch.Tensor:
        at = next(position)
        if at is None:
            made.append(tensor.detach().clone())  # sparse, quantized...: a plain copy
            return made[-1]
        view, source = slab.tensor(at, tensor), tensor.detach()
        setattr(view, STAGE_TOKEN, token)  # a save of it after the next stage is refused
        made.append(view)
        if can_move(view, source):
            moves.append((view, source))  # copied below, all at once (see copier)
            return view
        view.copy_(source, non_blocking=tensor.device.type == "cuda" and slab.pinned)
        if tensor.device.type == "cuda":
            devices.add(tensor.device)
        return view

    staged = _walk(state, place)
    move(moves)
    wait_for_copies(devices)
    return staged, token


def wait_for_copies(devices: set[torch.device]) -> None:
    """Wait for the device-to-host copies this thread queued: on each source tensor's device, on
    the stream the copy went to (this thread's current stream there). Not ``torch.cuda.synchronize()``,
    which waits on the thread's current device only (a staging thread's is device 0 whatever the
    rank's is) and on every stream of it, training's included."""
    for device in sorted(devices, key=str):
        torch.cuda.current_stream(device).synchronize()


def _copy_if_free(
    slab: Slab, state: Any, offsets: list[int | None], made: list[torch.Tensor]
) -> tuple[Any, bytes] | None:
    """:func:`_copy_into_slab` once no save is writing ``slab`` out (a retry of an earlier save, on
    a thread the back-pressure rule cannot see); None if that save adopted it as its checkpoint."""
    with slab.use.staging(), STAGING_NOW.get().held():
        if slab.consumed:
            return None
        return _copy_into_slab(slab, state, offsets, made)


class Stager:
    """Owns a writer's slabs in one process (the trainer's); see the module docstring."""

    def __init__(self, directory: OwnedDirectory | None) -> None:
        # Its lock is held for this process's life: cleanup anywhere (another PID namespace) asks it.
        self.directory = None if directory is None else directory.path
        self._lock_fd = None if directory is None else directory.lock
        self.slab: Slab | None = None
        self.spare: Slab | None = None
        # Spares are prepared and old slabs unmapped on one thread that outlives the saves.
        self._worker = SerialWorker("tierstore-slabs")
        self._preparing: Future[Any] | None = None
        self._retired: list[Slab] = []
        self._lock = threading.Lock()
        self._staging = threading.Lock()
        self._reused = False
        self.pending: Pending | None = None
        """The last save that staged into these buffers, until it is known to be over."""
        self.queue = StagingQueue()
        """Overlapped staging jobs, run one at a time in call order."""
        # Files still in the staging directory at exit never became checkpoints: remove them.
        finalize(self, _remove_directory, self.directory, self._lock_fd)

    def _new_slab(self, nbytes: int, *, preallocate: bool = False) -> Slab:
        path = None
        if self.directory is not None:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            path = os.path.join(self.directory, f"slab-{uuid.uuid4().hex}.bin")
            preallocate = _tight(self.directory, nbytes) or preallocate  # raises if it cannot fit
        return Slab(nbytes, path, preallocate=preallocate)

    def _prepare_spare(self, nbytes: int) -> None:
        def prepare() -> None:
            try:
                spare = self._new_slab(nbytes, preallocate=True)
                spare.populate()
            except Exception as exc:  # noqa: BLE001 - the next save will allocate on its own
                logger.warning("could not prepare a spare staging buffer: %s", exc)
                return
            with self._lock:
                old, self.spare = self.spare, spare
            if old is not None:
                old.release()

        self._preparing = self._worker.submit(prepare)

    def _prepare_spare_after_handover(self, nbytes: int) -> None:
        """Prepare the next save's spare once this save's thread has reported in.

        Woken during the stall, the slab worker contends for the GIL with the rest of
        ``async_save``: starting DCP's save thread took 3-20 ms instead of 0.3 ms on 2 cores, 3 %
        of a first save. The next stage waits for this save's thread to end, so the spare's job is
        always queued before that stage looks for it.
        """
        assert self.pending is not None
        self.pending.on_handover(lambda: self._prepare_spare(nbytes))

    def _retire(self) -> None:
        """Drop the retired slabs on the worker: unmapping a large mapping takes a while."""
        holder, self._retired = self._retired, []

        def drop() -> None:
            while holder:
                slab = holder.pop()
                # Zap the page tables through ctypes, which lets go of the GIL; torch's own unmap
                # (when the storage dies) holds it, and would pause the trainer's Python meanwhile.
                slab.drop_pages()
                slab.release()
                del slab

        self._worker.submit(drop)

    def _room_for_spare(self, nbytes: int) -> bool:
        """Whether the memory tier can take a spare of ``nbytes`` beside the checkpoint of as many."""
        assert self.directory is not None
        try:
            return not _tight(self.directory, nbytes)  # free >= checkpoint + spare + margin
        except TierUnavailableError:
            return False

    def _spare_in_progress(self) -> bool:
        return self._preparing is not None and not self._preparing.done()

    def _acquire(self, nbytes: int, *, preallocate: bool) -> tuple[Slab | None, float]:
        """A slab of ``nbytes`` to copy into (None: copy each tensor on its own, a memory tier's
        first save); returns it and the seconds spent waiting for a spare."""
        waited = 0.0
        # A slab the last save did not adopt (its rank wrote a compact file instead, see
        # rank_files) is simply used again: no spare is needed while that lasts.
        self._reused = self.slab is not None and not self.slab.consumed
        if self.slab is not None and (self.slab.consumed or self.slab.nbytes != nbytes):
            self._retired.append(self.slab)  # unmapped after the copy: munmap slows a copy beside it
            self.slab = None
        if self.slab is None and self._preparing is not None:
            started = time.perf_counter()
            self._preparing.result()
            waited = time.perf_counter() - started
        if self.slab is None:
            with self._lock:
                spare, self.spare = self.spare, None
            if spare is not None and spare.nbytes == nbytes:
                self.slab = spare
            else:
                if spare is not None:
                    spare.release()
                try:
                    if self.directory is not None and not torch.cuda.is_available():
                        _tight(self.directory, nbytes)  # the checkpoint must fit: raises if not
                        return None, waited  # no tmpfs slab ready: fresh private pages fault faster
                    self.slab = self._new_slab(nbytes, preallocate=preallocate)
                except BaseException:
                    self._retire()  # a refused save must not keep the spent slab's memory
                    raise
        return self.slab, waited

    def _drop_spare(self) -> None:
        if self._spare_in_progress():
            return  # it is being made now; the next save decides again
        with self._lock:
            spare, self.spare = self.spare, None
        if spare is not None:
            spare.release()

    def prepare(self, state: Any) -> None:
        """Allocate and map a slab for ``state`` in the background, ahead of the first save."""
        _offsets, nbytes = _layout(state)
        if self.slab is None and self.spare is None:
            self._prepare_spare(nbytes)

    def wait_for_previous_save(self) -> tuple[float, bool]:
        """Wait for the save that last staged here; return the wait, and whether it is over.

        False means it never reported in within :data:`~tierstore.dcp.staging.pending.REGISTRATION_TIMEOUT`:
        its buffer must be treated as still in use.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return 0.0, True
        started = time.perf_counter()
        over = pending.wait()
        return time.perf_counter() - started, over

    def wait_until_prepared(self) -> None:
        """Block until a background preparation (see :meth:`prepare`) has finished."""
        if self._preparing is not None:
            self._preparing.result()

    def stage(self, state: Any) -> StagedSave:
        """Copy ``state``'s tensors into a slab now.

        Runs on the caller's thread, after any overlapped staging still in progress here.
        """
        self.queue.wait_until_idle()
        return self._stage(state, preallocate=False)

    def stage_in_background(self, state: Any, finish: Callable[[StagedSave], Any]) -> StagingFuture:
        """Like :meth:`stage`, on a background thread (see :mod:`tierstore.dcp.staging.overlap`).

        ``finish(staged_save)`` runs on that thread once the copy is done; the future holds
        what it returns, or the exception staging raised. The caller must not modify ``state``
        until the future has resolved.
        """
        return self.queue.submit(lambda: finish(self._stage(state, preallocate=True)))

    def wait_until_idle(self) -> None:
        """Wait for overlapped staging in progress, then for the save that last staged here."""
        self.queue.wait_until_idle()
        with self._staging:  # not while another writer of the tier stages: it would skip its wait
            self.wait_for_previous_save()

    def _stage(self, state: Any, *, preallocate: bool) -> StagedSave:
        # Every writer of a tier in this process shares its stager: one stage at a time, each
        # handing its own Pending to the writer that staged (not whatever self.pending is by then).
        with self._staging:
            staged, slab, waited = self._stage_alone(state, preallocate=preallocate)
            assert self.pending is not None
            return StagedSave(staged, slab, waited, self.pending)

    def _stage_alone(self, state: Any, *, preallocate: bool) -> tuple[Any, SlabInfo | None, float]:
        offsets, nbytes = _layout(state)
        waited, over = self.wait_for_previous_save()
        if not over and self.slab is not None:
            logger.error("the previous save never reported back: staging into a new buffer")
            self.slab = None  # still in use: never written again; its save releases it
        if self.directory is not None and os.path.isdir(self.directory):
            os.utime(self.directory)  # alive: gc leaves the staging files of live writers alone
        made: list[torch.Tensor] = []  # the staged tensors: see Pending for why
        copied: tuple[Any, bytes] | None = None
        while copied is None:
            slab, spare_wait = self._acquire(nbytes, preallocate=preallocate)
            waited += spare_wait
            if slab is None:
                break
            copied = _copy_if_free(slab, state, offsets, made)
        if slab is None or copied is None:
            with STAGING_NOW.get().held():
                staged = _copy_into_fresh_memory(state, made)
            if self._retired:
                self._retire()
            self.pending = Pending(made)
            # The checkpoint file this save writes comes first: with no room for it and a spare
            # too, the next save allocates on its own (or is refused, naming the bytes).
            if self._room_for_spare(nbytes):
                self._prepare_spare_after_handover(nbytes)
            return staged, None, waited
        staged, token = copied
        if self._retired:
            self._retire()
        self.pending = Pending(made)
        if slab.path is not None and self._reused:
            self._drop_spare()  # this job's saves write compact files: the slab stays in use
        elif slab.path is not None:
            # The slab will become the checkpoint: ready the next one.
            self._prepare_spare_after_handover(nbytes)
        if slab.path is not None:  # its mtime says "in use" to gc, even after the rename
            os.utime(slab.path)
        return staged, SlabInfo(nbytes, token, slab.path), waited

    def close(self) -> None:
        """Release every slab this stager still owns."""
        self.queue.wait_until_idle()
        if self._preparing is not None:
            self._preparing.result()
        for slab in (self.slab, self.spare):
            if slab is not None:
                slab.release()
        self.slab = self.spare = None
        self._worker.close()
        self.queue.close()


class StagerRegistry:
    """This process's stagers, one per target tier: every ``TieredWriter`` writing there shares it.

    Training loops often build a writer per save (``storage_writer=TieredWriter(cfg)``); sharing the
    buffers, the spare and the back-pressure per target keeps such loops at the staging floor too.
    Per process (:class:`~tierstore._platform.runtime.ProcessLocal`), so that a forked child never writes
    into its parent's mappings. It holds buffers, never listings.
    """

    def __init__(self) -> None:
        self._stagers: dict[str, Stager] = {}
        self._lock = threading.Lock()

    def get(self, key: str, directory: Callable[[], OwnedDirectory | None]) -> Stager:
        """The stager for ``key``, created (with ``directory()`` for its slabs) on first use."""
        with self._lock:
            if key not in self._stagers:
                self._stagers[key] = Stager(directory())
            return self._stagers[key]

    def peek(self, key: str) -> Stager | None:
        """The stager for ``key`` if this process has one."""
        with self._lock:
            return self._stagers.get(key)

    def discard(self, key: str) -> Stager | None:
        """Forget (and return) the stager for ``key``."""
        with self._lock:
            return self._stagers.pop(key, None)


STAGERS = ProcessLocal(StagerRegistry)
"""This process's stagers (see :class:`StagerRegistry`)."""
