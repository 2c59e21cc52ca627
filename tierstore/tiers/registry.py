"""Tier type name -> adapter. Adding a tier type (GCS, Azure) is one module and one line here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierstore.config import Config, TierConfig
from tierstore.tiers.base import Tier
from tierstore.tiers.local import LocalTier
from tierstore.tiers.memory import MemoryTier
from tierstore.tiers.s3 import S3Tier
from tierstore.tiers.shared import SharedTier

ADAPTERS: dict[str, Callable[..., Tier]] = {
    "memory": MemoryTier.from_config,
    "local": LocalTier.from_config,
    "shared": SharedTier.from_config,
    "s3": S3Tier.from_config,
}


def make_tier(config: TierConfig, *, namespace: str | None, node: int) -> Tier:
    """Build the adapter for one configured tier, as seen from ``node``."""
    factory: Any = ADAPTERS[config.type]
    tier: Tier = factory(config, namespace=namespace, node=node)
    return tier


def make_tiers(config: Config, *, node: int) -> list[Tier]:
    """Every configured tier, fastest first, as seen from ``node``."""
    return [make_tier(t, namespace=config.namespace, node=node) for t in config.tiers]
