"""Unpickling DCP's ``.metadata`` without running arbitrary code.

DCP reads ``.metadata`` with plain ``pickle.load``: a crafted file in a shared tier or a bucket would run
code on every ``dcp.load``. tierstore checks the file's CRC32C against the commit marker first and then
unpickles it with an allowlist: DCP's own metadata classes, torch's ``Size``/``dtype``/``layout``/
``memory_format`` values, tierstore's storage records and a few builtins. Anything else is refused with
an error naming the global it tried to load.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from tierstore.dcp.layout import ItemLocation
from tierstore.errors import IntegrityError

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
_ALLOWED = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("collections", "OrderedDict"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
}


_STORAGE_RECORDS = {
    ("tierstore.dcp.layout", "ItemLocation"): ItemLocation,
    # Written by tierstore 0.1.0, before the DCP face moved into tierstore.dcp: same class.
    ("tierstore.serialize", "ItemLocation"): ItemLocation,
}


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STORAGE_RECORDS:
            return _STORAGE_RECORDS[(module, name)]
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def load_metadata(data: bytes, *, where: str) -> Any:
    """Unpickle DCP metadata from ``data``; :class:`IntegrityError` naming ``where`` if refused."""
    try:
        return _AllowlistUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
        raise IntegrityError(f"{where}: cannot load DCP metadata ({exc})") from None
