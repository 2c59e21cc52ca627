"""``shared`` tier: a POSIX path every node sees (Lustre, GPFS, NFS). Survives node loss.

Other nodes' writes raise no inotify events here, so discovery polls markers (see the promoter).
"""

from __future__ import annotations

from tierstore.config import SharedTierConfig
from tierstore.tiers.posix import PosixTier, join_namespace


class SharedTier(PosixTier):
    """A job-wide shared directory."""

    @classmethod
    def from_config(
        cls, config: SharedTierConfig, *, namespace: str | None, node: int
    ) -> SharedTier:
        """Build the tier (the same on every node)."""
        return cls(config.name, "shared", join_namespace(config.path, namespace), node_local=False)
