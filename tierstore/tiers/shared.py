"""``shared`` tier: a POSIX path every node sees (Lustre, GPFS, NFS). Survives node loss.

Other nodes' writes raise no inotify events here, so discovery polls markers (see the promoter).
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from tierstore.tiers.posix import PosixTierConfig
from tierstore.tiers.registry import register


@register
class SharedTierConfig(PosixTierConfig):
    """A POSIX path every node sees (Lustre, GPFS, NFS)."""

    type: Literal["shared"]

    @field_validator("path")
    @classmethod
    def _one_path_for_all_nodes(cls, value: str) -> str:
        if "{node}" in value:
            raise ValueError("'{node}' is only for node-local tiers (memory, local)")
        return value
