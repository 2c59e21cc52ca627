"""A tier's files as files of this host, for tests that damage, count or walk them behind the
tier's back. tierstore itself never does this (the Tier seam offers verbs instead; see
tests/test_architecture.py); a test may, through this one helper."""

from __future__ import annotations

from tierstore.tiers import Tier
from tierstore.tiers.posix import PosixTier


def real_path(tier: Tier, path: str = "") -> str | None:
    """The real path of ``path`` in ``tier``; None for a tier without local files (an S3 tier)."""
    if tier.local is None:
        return None
    assert isinstance(tier, PosixTier), f"{tier.describe()} has local files but is no directory"
    return tier.local_path(path)
