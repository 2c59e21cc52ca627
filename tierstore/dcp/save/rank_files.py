"""A rank's share of a save, turned into a few large files in the target tier.

File 0 holds the rank's tensors as raw bytes. When the state was staged (``async_save``), file 0 *is*
the staging slab: in a memory tier it is renamed into place (no copy at all); elsewhere it is written in
one sequential pass. Either way every byte is checksummed once, and with ``check_finite`` each floating
tensor is checked for NaN/Inf in the same cache-hot pass. File 1 holds DCP's byte items, tensors that
were not staged, and tensors that are not dense.

A slab is adopted at most once. A retry of a staged state whose slab an earlier save already renamed
away (that save failed after the rename, say with ENOSPC on file 1) writes the slab's pages, still
mapped by the staged views and holding exactly the staged bytes, out like any other tier would.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import io
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from tierstore._platform.killpoints import kill_point
from tierstore.dcp.layout import (
    HEADER_SIZE,
    MAGIC,
    ChunkSink,
    ItemLocation,
    aligned,
    dtype_name,
    encode_fallback,
    feed_tensor,
    has_nonfinite,
    header,
    is_raw_encodable,
    raw_view,
    stage_token,
    view_of,
)
from tierstore.dcp.save.gate import GateView
from tierstore.dcp.staging import SlabInfo, use_of
from tierstore.errors import NonFiniteTensorError, StaleStagedStateError, TierUnavailableError
from tierstore.ids import checkpoint_file, data_file
from tierstore.records.marker import FileEntry
from tierstore.tiers import Tier
from tierstore.tiers.base import WriteStream

logger = logging.getLogger(__name__)
_ADOPT_SHARE = 0.75
"""Adopt (or write out) the staging slab whole when this rank writes at least this share of it."""


@dataclass
class RankOutput:
    """What writing one rank's items produced."""

    results: list[WriteResult] = field(default_factory=list)
    files: list[FileEntry] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    gate: GateView | None = None


def _slab_token(storage: torch.UntypedStorage, tokens: dict[int, bytes]) -> bytes:
    """The token in the header of the slab ``storage`` is (read once per save: ``tokens``)."""
    key = storage.data_ptr()
    if key not in tokens:
        tokens[key] = bytes(view_of(storage, len(MAGIC), torch.uint8, (16,)).tolist())
    return tokens[key]


def _in_slab(tensor: torch.Tensor, slab: SlabInfo | None, tokens: dict[int, bytes]) -> bool:
    """True when ``tensor`` is a view into the staging slab this save was handed."""
    if slab is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    storage = tensor.untyped_storage()
    if storage.nbytes() != slab.nbytes:
        return False
    return _slab_token(storage, tokens) == slab.token


class RankFileWriter:
    """Writes one rank's items of one save (see the module docstring)."""

    def __init__(
        self,
        tier: Tier,
        checkpoint_id: str,
        generation: str,
        rank: int,
        *,
        node: int,
        slab: SlabInfo | None,
        check_finite: bool,
        sha256: bool,
    ) -> None:
        self.tier, self.checkpoint_id, self.generation = tier, checkpoint_id, generation
        self.rank, self.node, self.slab, self.check_finite = rank, node, slab, check_finite
        self.out = RankOutput(gate=GateView(checkpoint_id, rank))
        self.sha256 = sha256
        """Signed markers name each file's SHA-256 too: computed beside the CRC, in this pass."""

    @staticmethod
    def _hold_slab(tensor: torch.Tensor, holding: set[int], held: contextlib.ExitStack) -> None:
        """Keep stages out of the slab ``tensor`` views (if any) until this save has written it,
        before anything reads its header or bytes (see :mod:`tierstore.dcp.staging.slab_use`)."""
        if tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.is_nested:
            return  # sparse and nested tensors are never slab views (and have no one storage)
        try:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
        except RuntimeError:  # a wrapper subclass's storage has no data: not a slab view
            return
        if address in holding:
            return
        holding.add(address)
        use = use_of(storage)
        if use is not None:
            held.enter_context(use.reading())

    def _refuse_if_restaged(self, item: WriteItem, tensor: torch.Tensor, tokens: dict[int, bytes]) -> None:
        """A staged view whose slab no longer carries its stage's token was staged into again
        since: its bytes are a later state's. Raise rather than commit them under this id."""
        token = stage_token(tensor)
        if token is None:
            return
        if _slab_token(tensor.untyped_storage(), tokens) != token:
            raise StaleStagedStateError(
                f"checkpoint {self.checkpoint_id!r}: tensor {item.index.fqn!r} was staged for an"
                " earlier save, and its staging buffer has since been staged into again (a later"
                " stage() or async_save to this tier in this process); nothing was written. A"
                " staged state is good until the next stage: stage the state again to save it"
            )

    @contextlib.contextmanager
    def _open(self, full: str, size: int) -> Iterator[WriteStream]:
        """``tier.open_write(full)`` for a file of ``size`` bytes: a full tier's error says how many
        bytes the file needs and how many are free (the tier alone knows neither)."""
        try:
            with self.tier.open_write(full) as stream:
                self.out.written.append(full)
                yield stream
        except TierUnavailableError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
                raise
            try:
                space = local.space() if (local := self.tier.local) else None
            except TierUnavailableError:
                space = None
            free = "" if space is None else f", {space.total - space.used} are free"
            raise TierUnavailableError(f"{exc} (the file needs {size} bytes{free})", tier=exc.tier) from cause

    def _rel(self, index: int) -> str:
        return data_file(self.generation, self.rank, index)

    def write(self, items: list[WriteItem], planner: SavePlanner) -> RankOutput:
        """Write every item; raises (leaving ``out.written`` for cleanup) on any failure."""
        with contextlib.ExitStack() as held:  # the slabs read from, until written out
            return self._write_items(items, planner, held)

    def _write_items(
        self, items: list[WriteItem], planner: SavePlanner, held: contextlib.ExitStack
    ) -> RankOutput:
        assert self.out.gate is not None
        tokens: dict[int, bytes] = {}
        holding: set[int] = set()
        staged: list[tuple[WriteItem, torch.Tensor]] = []
        loose: list[tuple[WriteItem, torch.Tensor]] = []
        blobs: list[tuple[WriteItem, memoryview, str]] = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                self.out.gate.objects[item.index.fqn] = data
                blobs.append((item, data.getbuffer(), "bytes"))
                continue
            assert isinstance(data, torch.Tensor)
            self._hold_slab(data, holding, held)
            self._refuse_if_restaged(item, data, tokens)
            self.out.gate.tensors[item.index.fqn] = data
            if _in_slab(data, self.slab, tokens):
                staged.append((item, data))
            elif is_raw_encodable(data):
                loose.append((item, data))
            else:
                if self.check_finite and has_nonfinite(data):  # sparse, quantized, nested
                    raise NonFiniteTensorError(f"tensor {item.index.fqn!r} holds NaN or Inf")
                blobs.append((item, memoryview(encode_fallback(data)), "torch"))
        staged_bytes = sum(t.numel() * t.element_size() for _, t in staged)
        if staged and self.slab is not None and staged_bytes >= _ADOPT_SHARE * self.slab.nbytes:
            self._write_slab(staged)
        elif staged:
            # Most of the slab holds items DCP's planner gave to other ranks (a replicated model:
            # each rank staged it all, one rank writes each item). Writing the slab as it is would
            # store them N times over: this rank's items go into a compact file instead, and the
            # slab stays the staging buffer for the next save.
            self._write_file(self._rel(0), staged + loose, [])
            loose = []
        elif loose:  # a plain dcp.save: the tensors stream into file 0
            self._write_file(self._rel(0), loose, [])
            loose = []
        if loose or blobs:
            self._write_file(self._rel(1), loose, blobs)
        return self.out

    def _write_slab(self, staged: list[tuple[WriteItem, torch.Tensor]]) -> None:
        """The slab is file 0: checksum (and check) it in one pass; adopt it or write it out."""
        assert self.slab is not None
        storage = staged[0][1].untyped_storage()
        whole = memoryview((ctypes.c_ubyte * self.slab.nbytes).from_address(storage.data_ptr())).cast("B")
        rel = self._rel(0)
        full = checkpoint_file(self.checkpoint_id, rel)

        def scan(write: Callable[[memoryview], object] | None) -> tuple[ChunkSink, list[WriteResult]]:
            placed: list[Placed] = []
            with ChunkSink(write, sha256=self.sha256) as sink:
                _scan_into(sink, placed)
            return sink, with_crcs(placed, sink.marks)

        def _scan_into(sink: ChunkSink, placed: list[Placed]) -> None:
            for item, tensor in sorted(staged, key=lambda s: s[1].storage_offset() * s[1].element_size()):
                start = int(tensor.storage_offset()) * tensor.element_size()
                length = int(tensor.numel()) * tensor.element_size()
                sink.feed_span(whole, sink.size, start)  # header, padding, items of other ranks
                mark = sink.mark()
                feed_tensor(
                    sink,
                    tensor,
                    whole[start : start + length],
                    fqn=item.index.fqn,
                    check_finite=self.check_finite,
                )
                sink.mark()
                location = ItemLocation(
                    rel, start, length, "raw", dtype_name(tensor.dtype), tuple(tensor.shape)
                )
                placed.append((item, location, mark))
            sink.feed_span(whole, sink.size, self.slab.nbytes if self.slab else 0)

        sink: ChunkSink | None = None
        if self._adoptable():
            assert self.slab.path is not None
            # Every check passes before the slab becomes a checkpoint file.
            sink, results = scan(None)
            if not self._adopt(full, self.slab.path):
                sink = None  # adopted by another save meanwhile: write it out after all
        if sink is None:
            with self._open(full, self.slab.nbytes) as stream:
                sink, results = scan(stream.write)
        self.out.results.extend(results)
        self.out.files.append(FileEntry(rel, sink.size, sink.crc, self.rank, self.node, sink.sha256))

    def _adoptable(self) -> bool:
        """Whether file 0 can be the slab's file itself, renamed into the checkpoint.

        Not when the slab's file has left the staging directory: an earlier save of this staged
        state adopted it, then failed and removed it (ENOSPC on a later file, say), or committed
        under another id. The staged views still map its pages, and they hold exactly the staged
        bytes: a slab whose file left staging is never staged into again (``Slab.consumed``), and
        :meth:`_refuse_if_restaged` refused views of one restaged before. So the retry writes those
        pages out, like a tier that cannot adopt (one copy), instead of failing on a missing path.
        """
        assert self.slab is not None
        if self.slab.path is None or self.tier.local is None:
            return False
        if os.path.exists(self.slab.path):
            return True
        logger.info(
            "checkpoint %r: the staging buffer's file was adopted by an earlier save of this"
            " staged state; writing its bytes out to tier %s instead",
            self.checkpoint_id,
            self.tier.name,
        )
        return False

    def _adopt(self, full: str, slab_path: str) -> bool:
        """Rename the slab file ``slab_path`` into the checkpoint as ``full``; False (nothing
        moved) when another save of the same staged state adopted it first (see :meth:`_adoptable`).
        """
        try:
            fd = os.open(slab_path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:  # durable before its name moves into the checkpoint (a no-op on tmpfs)
            os.fsync(fd)
        finally:
            os.close(fd)
        local = self.tier.local
        assert local is not None  # see _adoptable
        try:
            local.adopt(full, slab_path)
        except FileNotFoundError:
            if os.path.exists(slab_path):
                raise  # something other than the slab is missing: a real failure
            return False
        self.out.written.append(full)
        return True

    def _add_tensor(
        self, sink: ChunkSink, rel: str, item: WriteItem, tensor: torch.Tensor, alive: list[torch.Tensor]
    ) -> Placed:
        view, owner = raw_view(tensor)
        # The sink checksums on a helper thread, later: a copy raw_view made (the values of a
        # lazily negated or conjugated tensor, say) must outlive the sink, or the CRC reads freed
        # memory.
        alive.append(owner)
        sink.pad_to(aligned(sink.size))
        offset = sink.size
        mark = sink.mark()
        feed_tensor(sink, owner, view, fqn=item.index.fqn, check_finite=self.check_finite)
        sink.mark()
        kill_point("writer.mid_file", rel)
        location = ItemLocation(rel, offset, len(view), "raw", dtype_name(tensor.dtype), tuple(tensor.shape))
        return item, location, mark

    def _write_file(
        self,
        rel: str,
        tensors: list[tuple[WriteItem, torch.Tensor]],
        blobs: list[tuple[WriteItem, memoryview, str]],
    ) -> None:
        """Stream tensors (64-byte aligned raw bytes), then byte items, into one new file."""
        full = checkpoint_file(self.checkpoint_id, rel)
        size = HEADER_SIZE
        for _item, tensor in tensors:
            size = aligned(size) + tensor.numel() * tensor.element_size()
        for _item, buffer, _encoding in blobs:
            size = aligned(size) + len(buffer)
        placed: list[Placed] = []
        alive: list[torch.Tensor] = []
        with self._open(full, size) as stream, ChunkSink(stream.write, sha256=self.sha256) as sink:
            sink.feed(memoryview(header(uuid.uuid4().bytes)))
            for item, tensor in tensors:
                placed.append(self._add_tensor(sink, rel, item, tensor, alive))
            for item, buffer, encoding in blobs:
                sink.pad_to(aligned(sink.size))
                offset = sink.size
                mark = sink.mark()
                sink.feed(buffer)
                sink.mark()
                placed.append((item, ItemLocation(rel, offset, len(buffer), encoding), mark))
        self.out.results.extend(with_crcs(placed, sink.marks))
        self.out.files.append(FileEntry(rel, sink.size, sink.crc, self.rank, self.node, sink.sha256))


Placed = tuple[WriteItem, ItemLocation, int]
"""An item written to a file: its location (no CRC yet) and the index of the sink's mark before it
(the one after it follows)."""


def with_crcs(placed: list[Placed], marks: list[int]) -> list[WriteResult]:
    """DCP's write results for ``placed``, each location carrying its item's running CRC32C before
    and after (:attr:`ItemLocation.crc`), read from the finished sink's ``marks``."""
    return [
        WriteResult(
            item.index, location.length, dataclasses.replace(location, crc=(marks[mark], marks[mark + 1]))
        )
        for item, location, mark in placed
    ]


__all__ = ["HEADER_SIZE", "RankFileWriter", "RankOutput"]
