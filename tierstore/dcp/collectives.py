"""The few collectives the DCP face uses, each a no-op at world size 1 (or without distributed)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tierstore.topology import is_distributed


class _Alone:
    """A process that decides alone, whatever groups exist (``dcp.load(no_dist=True)``)."""

    def __repr__(self) -> str:
        return "ALONE"


ALONE: Any = _Alone()
"""Pass as the group: every helper here acts as in a group of one."""


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (the default group), or ``(0, 1)`` without distributed
    or for :data:`ALONE`."""
    if group is ALONE or not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def broadcast_object(value: Any, group: dist.ProcessGroup | None = None, src: int = 0) -> Any:
    """Group rank ``src``'s ``value`` (rank 0's by default) on every rank of ``group``."""
    _, world = rank_and_world(group)
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group_src=src, group=group)
    return box[0]


def all_gather_object(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    _, world = rank_and_world(group)
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out
