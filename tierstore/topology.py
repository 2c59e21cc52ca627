"""Where this process sits: its node index, rank and world size.

The node index picks a node-local tier's directory (``path: /dev/shm/tierstore/{node}``). It comes from,
in order: an explicit ``node=`` argument, ``TIERSTORE_NODE``, torchrun's ``GROUP_RANK``, Slurm's
``SLURM_NODEID``, else 0. These variables describe placement, not tuning: every tuning knob lives in the
YAML file.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: the promoter and the CLI never need it
    import torch.distributed as dist

_NODE_VARIABLES = ("TIERSTORE_NODE", "GROUP_RANK", "SLURM_NODEID")


def current_node(explicit: int | None = None) -> int:
    """The node index of this process (see the module docstring for the order of sources)."""
    if explicit is not None:
        return _non_negative(explicit, "node")
    for variable in _NODE_VARIABLES:
        value = os.environ.get(variable)
        if value not in (None, ""):
            try:
                return _non_negative(int(value), variable)
            except ValueError:
                raise ValueError(
                    f"environment variable {variable}={value!r}: expected a node index >= 0"
                ) from None
    return 0


def _non_negative(value: int, what: str) -> int:
    if value < 0:
        raise ValueError(f"{what}={value}: expected a node index >= 0")
    return value


def is_distributed() -> bool:
    """True when a default torch.distributed process group is initialised."""
    import sys

    if "torch.distributed" not in sys.modules:
        return False  # nobody imported it, so nobody initialised a process group
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (the default group), or ``(0, 1)`` without distributed."""
    if not is_distributed():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)
