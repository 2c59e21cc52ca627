"""Where the bytes of a data object go when most of it is read: straight into the destinations.

A tensor whose destination is exactly its stored bytes (raw encoding, the whole stored chunk, a
contiguous CPU tensor of the stored dtype) is read into the tensor's own memory: no buffer of the
object's size, no second pass copying out of it (measured on a 1 GiB object, that buffer and copy were
a tenth of an S3 restore, and they doubled its peak memory). Every other item (byte items, ``torch``
encoded or sliced tensors) gets a buffer of its own, decoded afterwards.

The object is fetched as a few large ranged GETs, as before: adjacent items (64-byte padding between
them is read into scratch) form runs, and runs are cut into pieces of at most ``chunk`` bytes, each one
GET whose body is streamed into its list of destinations in order. A gap no item needs, larger than
:data:`SKIP_GAP`, is not fetched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from tierstore.dcp.layout import ItemLocation, to_dtype

SKIP_GAP = 2**20
"""Bytes between two needed items above which the GET is split instead of reading them."""


@dataclass
class Piece:
    """One ranged GET: ``offset`` in the object and the destinations its body fills, in order."""

    offset: int
    outs: list[memoryview] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Bytes the GET asks for."""
        return sum(len(out) for out in self.outs)


def in_place_target(item: ReadItem, location: ItemLocation, planner: LoadPlanner) -> torch.Tensor | None:
    """The destination tensor when its memory can take the stored bytes as they are, else None."""
    if item.type == LoadItemType.BYTE_IO or location.encoding != "raw" or location.shape is None:
        return None
    target = planner.resolve_tensor(item).detach()
    whole_chunk = all(o == 0 for o in item.storage_offsets) and list(item.lengths) == list(location.shape)
    fits = (
        whole_chunk
        and target.device.type == "cpu"
        and not target.is_conj()  # a lazily conjugated or negated view reads its memory
        and not target.is_neg()  # through that bit: raw bytes would come back transformed
        and target.is_contiguous()
        and target.dtype == to_dtype(location.dtype or "uint8")
        and target.numel() * target.element_size() == location.length
    )
    return target if fits else None


def pieces(spans: list[tuple[int, memoryview]], chunk: int) -> list[Piece]:
    """Cut ``spans`` (``(offset, destination)``, sorted, not overlapping) into GETs of at most
    ``chunk`` bytes. Raises ``ValueError`` when two spans overlap."""
    found: list[Piece] = []
    room, end = 0, -1
    for offset, view in _with_padding(spans):
        if not found or offset != end:  # a gap worth skipping: a new GET
            found.append(Piece(offset))
            room = chunk
        position = 0
        while position < len(view):
            if not room:
                found.append(Piece(offset + position))
                room = chunk
            take = min(room, len(view) - position)
            found[-1].outs.append(view[position : position + take])
            position, room = position + take, room - take
        end = offset + len(view)
    return found


def _with_padding(spans: list[tuple[int, memoryview]]) -> list[tuple[int, memoryview]]:
    """``spans`` without empty ones, with scratch for gaps up to :data:`SKIP_GAP` between them."""
    padded: list[tuple[int, memoryview]] = []
    end = -1
    for offset, view in spans:
        if offset < end:
            raise ValueError(f"spans overlap at byte {offset}")
        if not len(view):
            continue
        if padded and 0 < offset - end <= SKIP_GAP:
            padded.append((end, memoryview(bytearray(offset - end))))
        padded.append((offset, view))
        end = offset + len(view)
    return padded
