"""``memory`` tier: a tmpfs directory on each node (default ``/dev/shm/tierstore``).

The fastest tier: a save's staging buffers are files in this directory, so staging *is* the write
(see :mod:`tierstore.staging`). It survives the trainer process, not the node.
"""

from __future__ import annotations

from tierstore.config import MemoryTierConfig
from tierstore.tiers.posix import PosixTier, join_namespace


class MemoryTier(PosixTier):
    """Host memory (tmpfs), node-local."""

    supports_staging_files = True

    @classmethod
    def from_config(
        cls, config: MemoryTierConfig, *, namespace: str | None, node: int
    ) -> MemoryTier:
        """Build the tier for ``node``."""
        return cls(
            config.name, "memory", join_namespace(config.path_for(node), namespace), node_local=True
        )
