"""Files in the format of torch's own ``FileSystemWriter``, for ``FileSystemReader`` to load.

torch's reader looks up each item's ``_StorageInfo`` (file relative to the checkpoint directory,
byte offset, length) in ``.metadata``'s ``storage_data``; it ``torch.load``\\ s a tensor item from
that byte range and hands a byte item's range to the planner as it is. So a tensor is written as
``torch.save`` output and a byte item as its bytes, one after another in a file, exactly as
``FileSystemWriter._write_item`` does without extensions. ``.metadata`` is a plain pickle of DCP's
``Metadata``. Every file is ``fsync``\\ ed before it is closed: the directory is renamed into place
afterwards, and a rename must not publish data that is not yet on disk.

``_StorageInfo`` is private to torch; ``tests/dcp/test_torch_contract.py`` fails loudly if it moves.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

METADATA_NAME = ".metadata"
"""The name torch's ``FileSystemReader`` reads the metadata from (without a rank suffix)."""


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TorchDataFile:
    """One new data file: items appended in order, each returning its ``_StorageInfo``.

    ``name`` is relative to ``directory`` and must not exist yet. :meth:`close` makes it durable and
    returns its size; on an error the caller removes the whole directory.
    """

    def __init__(self, directory: Path, name: str) -> None:
        self.name = name
        self._stream: BinaryIO = open(directory / name, "xb")  # noqa: SIM115 - closed in close()

    def add_tensor(self, tensor: torch.Tensor) -> _StorageInfo:
        """Append ``torch.save(tensor)`` (CPU; its storage should hold just this tensor)."""
        offset = self._stream.tell()
        torch.save(tensor, self._stream)
        return _StorageInfo(self.name, offset, self._stream.tell() - offset)

    def add_bytes(self, data: bytes | bytearray | memoryview) -> _StorageInfo:
        """Append a byte item (or bytes already in ``torch.save`` form) unchanged."""
        offset = self._stream.tell()
        self._stream.write(data)
        return _StorageInfo(self.name, offset, len(data))

    def close(self) -> int:
        """Flush, ``fsync`` and close; return the file's size."""
        size = self._stream.tell()
        self._stream.flush()
        os.fsync(self._stream.fileno())
        self._stream.close()
        return size

    def discard(self) -> None:
        """Close without syncing (the caller removes the directory)."""
        self._stream.close()


def write_metadata(directory: Path, metadata: Metadata) -> int:
    """Write ``metadata`` as torch's ``.metadata`` in ``directory``, durably; return its size."""
    with open(directory / METADATA_NAME, "xb") as stream:
        pickle.dump(metadata, stream)
        size = stream.tell()
        stream.flush()
        os.fsync(stream.fileno())
    return size
