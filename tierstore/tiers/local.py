"""``local`` tier: node-local disk (NVMe). Survives process crashes and most reboots, not node loss."""

from __future__ import annotations

from tierstore.config import LocalTierConfig
from tierstore.tiers.posix import PosixTier, join_namespace


class LocalTier(PosixTier):
    """A node-local directory."""

    @classmethod
    def from_config(cls, config: LocalTierConfig, *, namespace: str | None, node: int) -> LocalTier:
        """Build the tier for ``node``."""
        return cls(
            config.name, "local", join_namespace(config.path_for(node), namespace), node_local=True
        )
