"""The ``s3`` tier type: config (registered on import), adapter, uploads and retry policy."""

from tierstore.tiers.s3.config import S3TierConfig

__all__ = ["S3TierConfig"]
