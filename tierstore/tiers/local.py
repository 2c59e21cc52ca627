"""``local`` tier: node-local disk (NVMe). Survives process crashes and most reboots, not node loss."""

from __future__ import annotations

from typing import ClassVar, Literal

from tierstore.tiers.posix import PosixTierConfig
from tierstore.tiers.registry import register


@register
class LocalTierConfig(PosixTierConfig):
    """Node-local disk (NVMe); each node has its own (``path`` may contain ``{node}``)."""

    type: Literal["local"]
    node_local: ClassVar[bool] = True
