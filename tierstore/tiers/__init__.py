"""Storage tiers: one small interface (:class:`~tierstore.tiers.base.Tier`), one adapter per medium."""

from tierstore.tiers.base import FileInfo, Tier
from tierstore.tiers.registry import make_tier, make_tiers

__all__ = ["FileInfo", "Tier", "make_tier", "make_tiers"]
