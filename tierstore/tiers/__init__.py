"""Storage tiers: the :class:`~tierstore.tiers.base.Tier` seam and one module per tier type.

Importing this package registers the built-in types (``memory``, ``local``, ``shared``, ``s3``). A new
type is one more module that registers its config model (:func:`~tierstore.tiers.registry.register`);
import it before loading a configuration that names it.
"""

from tierstore.tiers import local, memory, s3, shared
from tierstore.tiers.base import (
    Capabilities,
    FileInfo,
    IncompleteWrite,
    LocalFace,
    OwnedDirectory,
    RetryHook,
    Space,
    Tier,
    TierConfig,
    is_host_memory,
)
from tierstore.tiers.landing import Landing
from tierstore.tiers.registry import make_tier, register, tier_types

BUILT_IN = (memory, local, shared, s3)
"""The modules of the built-in tier types (imported for their registration)."""

__all__ = [
    "BUILT_IN",
    "Capabilities",
    "FileInfo",
    "IncompleteWrite",
    "Landing",
    "LocalFace",
    "OwnedDirectory",
    "RetryHook",
    "Space",
    "Tier",
    "TierConfig",
    "is_host_memory",
    "make_tier",
    "register",
    "tier_types",
]
