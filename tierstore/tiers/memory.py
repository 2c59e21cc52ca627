"""``memory`` tier: a tmpfs directory on each node (default ``/dev/shm/tierstore``).

The fastest tier: a save's staging buffers are files in this directory, so staging *is* the write
(see :mod:`tierstore.dcp.staging`). It survives the trainer process, not the node.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from tierstore.tiers.base import Capabilities
from tierstore.tiers.posix import POSIX_CAPABILITIES, PosixTier, PosixTierConfig, join_namespace
from tierstore.tiers.registry import register


class MemoryTier(PosixTier):
    """Host memory (tmpfs), node-local; writers stage saves in files here."""

    capabilities = Capabilities(**{**POSIX_CAPABILITIES.__dict__, "staging_files": True})


@register
class MemoryTierConfig(PosixTierConfig):
    """Host memory: a tmpfs directory on each node (default ``/dev/shm/tierstore``)."""

    type: Literal["memory"]
    path: str = "/dev/shm/tierstore"
    node_local: ClassVar[bool] = True

    def build(self, *, namespace: str | None, node: int) -> MemoryTier:
        """The tier on ``node``."""
        directory = join_namespace(self.path_for(node), namespace)
        return MemoryTier(self.name, "memory", directory, node_local=True)
