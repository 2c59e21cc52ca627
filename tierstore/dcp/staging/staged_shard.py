"""A staged DTensor shard: a plain tensor that DCP plans exactly as it would plan the DTensor.

``stage()`` cannot hand DCP a ``DTensor`` wrapped around its staging buffer: in
``AsyncCheckpointerType.PROCESS`` mode DCP pickles the staged state to its checkpoint process, and a
DTensor (a wrapper tensor subclass without storage of its own) is pickled by sharing a null storage,
which crashes the trainer with SIGSEGV inside ``_share_fd_cpu_``. A :class:`StagedShard` *is* the
rank's local shard (a view of the slab, whose shared-memory storage travels by file descriptor), and
carries what DCP asks a DTensor for through its checkpoint protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``): the shard's offsets and sizes in the global
tensor, and the global size. The write items, hence the checkpoint, are the same as for the DTensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor


class StagedShard(torch.Tensor):
    """The local shard of a DTensor, staged (see the module docstring). Build with :meth:`of`."""

    _tierstore_chunk: ChunkStorageMetadata
    _tierstore_global_size: torch.Size

    @staticmethod
    def of(local: torch.Tensor, source: DTensor) -> StagedShard:
        """``local`` (the staged copy of ``source.to_local()``) marked with ``source``'s placement.

        Raises ValueError for a DTensor with ``Partial`` placements, as DCP itself does.
        """
        (chunk,) = source.__create_chunk_list__()  # type: ignore[no-untyped-call]
        shard = local.as_subclass(StagedShard)
        shard._tierstore_chunk = chunk
        shard._tierstore_global_size = source.size()
        return shard

    def __create_write_items__(self, fqn: str, _object: Any) -> list[WriteItem]:
        """The one write item of this rank's shard (as DCP builds it for a DTensor)."""
        chunk = self._tierstore_chunk
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self.plain()),
                    size=self._tierstore_global_size,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Where this shard sits in the global tensor."""
        return [self._tierstore_chunk]

    def __get_tensor_shard__(self, _index: MetadataIndex) -> torch.Tensor:
        """The shard's data, as a plain tensor (what DCP's planner hands the storage writer)."""
        return self.plain()

    def plain(self) -> torch.Tensor:
        """The same memory as a plain ``torch.Tensor``."""
        return self.as_subclass(torch.Tensor)
