"""The job's own gloo groups for moving checkpoint files between nodes.

Two groups over every rank, separate from the training group (which may be NCCL, and whose
collectives must never interleave with ours): one for the mirror exchange after saves, which runs on a
background thread, and one for peer restore, which runs inside ``dcp.load``. Keeping them apart means a
restore can never match a message of a mirror round still in flight. Both are created together, once
per process, by whichever needs them first, under a lock, so every rank creates them in the same order
(``new_group`` is collective). No listening service, no credentials: they live in the job's rendezvous.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass

import torch.distributed as dist

from tierstore._platform.runtime import ProcessLocal
from tierstore.topology import is_distributed


@dataclass(frozen=True)
class JobGroups:
    """The mirror-exchange and peer-restore groups of this process's job."""

    mirror: dist.ProcessGroup
    restore: dist.ProcessGroup


_lock = threading.Lock()
_groups: ProcessLocal[dict[int, tuple[object, JobGroups]]] = ProcessLocal(dict)
"""Keyed by the default group's id; the value keeps that group alive so its id is never reused."""


def job_groups(timeout_s: float) -> JobGroups | None:
    """This job's groups, created on first use (a collective: call it on every rank); None when
    the job has a single rank. ``timeout_s`` bounds every wait on a peer in them."""
    if not is_distributed() or dist.get_world_size() < 2:
        return None
    world = dist.group.WORLD
    key = id(world)
    with _lock:
        groups = _groups.get()
        if key not in groups:
            timeout = datetime.timedelta(seconds=max(1.0, timeout_s))
            mirror = dist.new_group(backend="gloo", timeout=timeout)
            restore = dist.new_group(backend="gloo", timeout=timeout)
            assert mirror is not None and restore is not None
            groups[key] = (world, JobGroups(mirror, restore))
        return groups[key][1]
