"""How items are laid out in data files, and the single pass that checksums (and checks) them.

A data file is a 64-byte header (magic ``TIERSTR1`` + a 16-byte token) followed by items, each aligned
to 64 bytes. A dense tensor is stored as its raw bytes (C order); DCP's byte items as given; anything
else (sparse, quantized) as ``torch.save`` output. :class:`ItemLocation` (DCP's ``storage_data`` for
an item) says where and how. Every byte is seen once on the way out: the same cache-hot chunk is
written, fed to CRC32C and, if asked, checked for NaN/Inf.
"""

from __future__ import annotations

import ctypes
import functools
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierstore._platform.runtime import SerialWorker
from tierstore.checksum import Digest
from tierstore.errors import NonFiniteTensorError

ALIGN = 64
HEADER_SIZE = 64
MAGIC = b"TIERSTR1"
CHUNK = 4 * 2**20
"""Bytes per pass: small enough to stay in cache between write, CRC and finiteness check."""
_BATCH = 2**20
"""Bytes of small chunks a :class:`ChunkSink` gathers before its helper checksums them in one job
(a large chunk goes at once: the checksum still overlaps the write)."""


@dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item lives: ``path`` (``<gen>/<file>``), byte range, and its encoding."""

    path: str
    offset: int
    length: int
    encoding: str
    """``raw`` (tensor bytes), ``bytes`` (DCP byte item) or ``torch`` (``torch.save`` of a tensor)."""
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    crc: tuple[int, int] | None = None
    """The file's running CRC32C just before the item and just after it: the item's bytes are
    intact when ``crc32c(bytes, crc[0]) == crc[1]`` (as strong a check as the item's own CRC32C,
    and free for the writer, which computes the file's CRC anyway). None in checkpoints saved
    before tierstore recorded it: their items are checked by reading the whole file."""


STAGE_TOKEN = "_tierstore_stage_token"  # noqa: S105 - an attribute name, not a secret
"""The attribute on a staged view that holds the token its stage wrote into the slab's header."""


def stage_token(tensor: torch.Tensor) -> bytes | None:
    """The token of the stage that made ``tensor``, or the view it was cut or aliased from (DCP's
    narrowed shards, StagedShard's ``as_subclass`` aliases: their ``_base``); None if unknown."""
    token = getattr(tensor, STAGE_TOKEN, None)
    if token is None and tensor._base is not None:
        token = getattr(tensor._base, STAGE_TOKEN, None)
    return token if isinstance(token, bytes) else None


def header(token: bytes) -> bytes:
    """The 64-byte file header carrying ``token`` (16 bytes)."""
    return (MAGIC + token).ljust(HEADER_SIZE, b"\0")


def aligned(offset: int) -> int:
    """``offset`` rounded up to the item alignment."""
    return -(-offset // ALIGN) * ALIGN


def is_raw_encodable(tensor: torch.Tensor) -> bool:
    """Dense, strided CPU/accelerator tensors are stored as raw bytes."""
    return tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested


def raw_view(tensor: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """The bytes of a dense tensor, without copying when it is CPU and contiguous.

    Returns the view and the tensor that owns its memory (keep it alive while using the view).
    """
    flat = tensor.detach().resolve_conj().resolve_neg()  # the values, not the memory under a bit
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b""), flat
    array = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    return memoryview(array).cast("B"), flat


def memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor's own memory, writable, without a copy (keep the tensor
    alive while using the view)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def view_of(
    storage: torch.UntypedStorage, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A contiguous tensor of ``dtype``/``shape`` over ``storage`` from byte ``offset`` (aligned)."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    element = torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype).set_(storage, offset // element, shape, tuple(reversed(strides)))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    """The inverse of :func:`dtype_name`; ValueError for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def is_checked_dtype(dtype: torch.dtype) -> bool:
    """Floating and complex dtypes can hold NaN/Inf."""
    return dtype.is_floating_point or dtype.is_complex


class ChunkSink:
    """Consumes the bytes of one file in order: CRC32C always (and SHA-256 when ``sha256``, for a
    signed marker), a write when a stream is given.

    When writing, the CRC runs on a helper thread (a :class:`~tierstore._platform.runtime.SerialWorker` of the
    sink's own), in order, overlapping the write (crc32c releases the GIL), so checksumming adds no
    time to a disk or tmpfs write. Use it as a context manager, or read :attr:`crc` once everything
    was fed: both wait for the helper, and raise what the checksum raised there (as :meth:`feed`
    does without a writer): a file whose bytes were not all checksummed gets no CRC32C at all.
    """

    def __init__(self, write: Callable[[memoryview], object] | None, *, sha256: bool = False) -> None:
        self._write = write
        self._digest = Digest(sha256=sha256)
        self.size = 0
        self._marks: list[int] = []
        self._noted = 0
        self._helper = None if write is None else SerialWorker("tierstore-crc")
        self._batch: list[memoryview | None] = []
        """Chunks (and marks: None) not yet handed to the helper, and their bytes below."""
        self._batched = 0
        self._failed: Exception | None = None
        """What the helper's checksum raised: the rest is skipped, every read raises it."""

    def _take(self, entry: memoryview | None) -> None:
        """Fold ``entry`` in on this thread (no helper), or queue it for the helper: in batches of
        at least :data:`_BATCH` bytes, since a job per small item (5,000 small tensors: 20,000 jobs)
        would cost the writer more time handing them over than the checksum takes."""
        if self._helper is None:
            self._fold([entry])
            return
        self._batch.append(entry)
        self._batched += 0 if entry is None else len(entry)
        if self._batched >= _BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._helper is not None and self._batch:
            self._helper.post(functools.partial(self._fold_on_helper, self._batch))
            self._batch, self._batched = [], 0

    def _fold(self, entries: list[memoryview | None]) -> None:
        for entry in entries:
            if entry is None:
                self._marks.append(self._digest.crc)
            else:
                self._digest.update(entry)

    def _fold_on_helper(self, entries: list[memoryview | None]) -> None:
        # The worker only logs a posted job's failure: the sink keeps it, so that the file fails.
        if self._failed is None:
            try:
                self._fold(entries)
            except Exception as exc:  # noqa: BLE001 - raised on the writer's thread by _finish
                self._failed = exc

    def __enter__(self) -> ChunkSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_exc: object) -> None:
        self._finish(raise_failure=exc_type is None)  # the block's own error says more

    def _finish(self, *, raise_failure: bool = True) -> None:
        if self._helper is not None:
            self._hand_over()
            self._helper.wait_idle()
            self._helper.close()
            self._helper = None
        if self._failed is not None and raise_failure:
            raise self._failed

    @property
    def crc(self) -> int:
        """The CRC32C of everything fed so far (waits for the helper thread)."""
        self._finish()
        return self._digest.crc

    @property
    def sha256(self) -> str | None:
        """The SHA-256 of everything fed so far, if asked for (waits for the helper thread)."""
        self._finish()
        return self._digest.sha256

    def mark(self) -> int:
        """Note the CRC32C of everything fed so far (an item's boundary); returns the note's index
        in :attr:`marks`."""
        self._take(None)
        self._noted += 1
        return self._noted - 1

    @property
    def marks(self) -> list[int]:
        """The CRC32C noted by each :meth:`mark` call, in order (waits for the helper thread)."""
        self._finish()
        return self._marks

    def feed(self, view: memoryview) -> None:
        """One chunk: write it (if writing), fold it into the CRC."""
        if self._write is not None:
            self._write(view)
        # On the helper, the memory stays alive: it belongs to the caller's tensors.
        self._take(view)
        self.size += len(view)

    def feed_span(self, whole: memoryview, start: int, end: int) -> None:
        """Feed ``whole[start:end]`` (bytes already in memory), a chunk at a time."""
        for position in range(start, end, CHUNK):
            self.feed(whole[position : min(position + CHUNK, end)])

    def pad_to(self, offset: int) -> None:
        """Zero-fill up to ``offset``."""
        if offset > self.size:
            self.feed(memoryview(bytes(offset - self.size)))


def feed_tensor(
    sink: ChunkSink, tensor: torch.Tensor, view: memoryview, *, fqn: str, check_finite: bool
) -> None:
    """Feed a tensor's bytes chunk by chunk; with ``check_finite``, refuse NaN/Inf as they pass."""
    if not view:
        return
    flat = tensor.reshape(-1)
    checked = check_finite and is_checked_dtype(tensor.dtype)
    step = max(1, CHUNK // max(1, tensor.element_size()))
    item = tensor.element_size()
    for start in range(0, flat.numel(), step):
        stop = min(start + step, flat.numel())
        if checked and not bool(torch.isfinite(flat[start:stop]).all()):
            raise NonFiniteTensorError(f"tensor {fqn!r} holds NaN or Inf")
        sink.feed(view[start * item : stop * item])


def has_nonfinite(tensor: torch.Tensor) -> bool:
    """NaN or Inf anywhere in a tensor of any layout (dense, sparse, quantized, nested)."""
    if not is_checked_dtype(tensor.dtype) and not tensor.is_quantized:
        return False
    if tensor.is_quantized:
        tensor = tensor.dequantize()
    elif tensor.is_nested:
        return any(has_nonfinite(part) for part in tensor.unbind())
    elif tensor.layout == torch.sparse_coo:
        tensor = tensor.coalesce().values()
    elif tensor.layout != torch.strided:  # CSR, CSC, BSR, BSC: their stored values
        tensor = tensor.values()
    return not bool(torch.isfinite(tensor.detach()).all())


def encode_fallback(tensor: torch.Tensor) -> bytes:
    """``torch.save`` bytes for tensors that are not dense (sparse, quantized, nested)."""
    buffer = io.BytesIO()
    torch.save(tensor.detach().cpu(), buffer)
    return buffer.getvalue()


def decode_tensor(data: bytes | bytearray | memoryview, location: ItemLocation) -> torch.Tensor:
    """Rebuild the stored tensor of ``location`` from its bytes (a CPU tensor sharing ``data``)."""
    if location.encoding == "torch":
        tensor = torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{location.path}@{location.offset}: expected a tensor")
        return tensor
    dtype = to_dtype(location.dtype or "uint8")
    shape = location.shape or ()
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # Read-only bytes (an S3 download) are only ever a copy source here, never written.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
