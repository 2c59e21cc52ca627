"""tierstore: a tiered-storage checkpoint engine for PyTorch Distributed Checkpoint (DCP).

Save to the fastest tier (host memory), commit with a marker written last, promote in the background
to NVMe, a parallel filesystem and S3, and restore from the fastest tier holding a complete copy::

    import torch.distributed.checkpoint as dcp
    from tierstore import TieredWriter, TieredReader, load_config, latest_committed

    cfg = load_config("tierstore.yaml")
    fut = dcp.async_save(state, storage_writer=TieredWriter(cfg), checkpoint_id="step_000200")
    ckpt = latest_committed(cfg)
    if ckpt:
        dcp.load(state, storage_reader=TieredReader(cfg), checkpoint_id=ckpt)
"""

import importlib
from typing import TYPE_CHECKING, Any

from tierstore.config import Config, load_config
from tierstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitVetoedError,
    ConfigError,
    IntegrityError,
    InvalidCheckpointIdError,
    NonFiniteTensorError,
    StaleStagedStateError,
    TierMisconfiguredError,
    TierstoreError,
    TierUnavailableError,
)
from tierstore.records.catalog import Catalog
from tierstore.version import __version__

if TYPE_CHECKING:
    from tierstore.dcp.manager import CheckpointManager
    from tierstore.dcp.restore import TieredReader
    from tierstore.dcp.save import GateView, LossBandGate, TieredWriter
    from tierstore.dcp.tools import ExportReport, export_checkpoint, latest_committed

# The DCP faces (tierstore.dcp.*) import torch; the core, the CLI and the promoter never do.
_LAZY = {
    **dict.fromkeys(["TieredWriter", "GateView", "LossBandGate"], "tierstore.dcp.save"),
    "TieredReader": "tierstore.dcp.restore",
    "CheckpointManager": "tierstore.dcp.manager",
    **dict.fromkeys(["latest_committed", "export_checkpoint", "ExportReport"], "tierstore.dcp.tools"),
}


def __getattr__(name: str) -> Any:
    """Import the torch-dependent names on first use: the CLI and promoter never load torch."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tierstore' has no attribute {name!r}")


__all__ = [
    "Catalog",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitVetoedError",
    "Config",
    "ConfigError",
    "ExportReport",
    "GateView",
    "IntegrityError",
    "InvalidCheckpointIdError",
    "LossBandGate",
    "NonFiniteTensorError",
    "StaleStagedStateError",
    "TierMisconfiguredError",
    "TierUnavailableError",
    "TieredReader",
    "TieredWriter",
    "TierstoreError",
    "__version__",
    "export_checkpoint",
    "latest_committed",
    "load_config",
]
