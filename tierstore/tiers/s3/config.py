"""The ``s3`` tier type: its registration, and the adapter its fields build."""

from __future__ import annotations

from tierstore.tiers.base import RetryHook
from tierstore.tiers.registry import register
from tierstore.tiers.s3.fields import S3Fields
from tierstore.tiers.s3.tier import S3Tier


@register
class S3TierConfig(S3Fields):
    """The ``s3`` type as registered: its fields (:class:`S3Fields`) build an :class:`S3Tier`."""

    def build(self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None) -> S3Tier:
        """The tier (the same on every node)."""
        return S3Tier(self, namespace=namespace, on_retry=on_retry)
