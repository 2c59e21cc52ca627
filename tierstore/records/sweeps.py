"""The sweep record: when the last complete cleanup of a tier ended, as the tier stamped it.

A cleanup (:mod:`tierstore.promote.cleanup`) lists the whole tier, every file of every retained
checkpoint: at 10,000 retained, a hundred S3 pages and most of a new promoter's first pass. A
promoter sweeps each tier it looks after every ``min(promote.stale_after / 2, 10 min)``; the record
(``.tierstore/swept``, empty, its mtime the tier's clock when the sweep ended) lets a restarted
promoter, or a new keeper of a job-wide tier, count the sweep its predecessor finished instead of
sweeping again at once. Nothing depends on it for safety: a cleanup removes only what has been left
alone for ``stale_after`` anyway, and a missing or unreadable record means a sweep is due.
"""

from __future__ import annotations

from tierstore.ids import SWEPT_PATH
from tierstore.records.clock import tier_now
from tierstore.tiers import Tier


def record_sweep(tier: Tier) -> None:
    """Say that a complete cleanup of ``tier`` ended now. Raises what the tier raises."""
    tier.write_bytes(SWEPT_PATH, b"")


def since_sweep(tier: Tier) -> float | None:
    """Seconds since the last complete cleanup of ``tier`` ended, on the tier's clock; None when no
    record says (never swept, or by a release before the record). Raises what the tier raises."""
    try:
        swept = tier.stat(SWEPT_PATH).mtime
    except FileNotFoundError:
        return None
    return tier_now(tier) - swept
