"""A pass sweeps a tier for leftovers when its last complete sweep, by this promoter or the one
before it, is ``min(stale_after / 2, 10 min)`` old (:mod:`tierstore.records.sweeps`): a restarted
promoter does not list every retained checkpoint again at once; ``tierstore gc`` always sweeps."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tierstore.config import Config
from tierstore.ids import SWEPT_PATH
from tierstore.promote.sidecar import Promoter
from tierstore.records.clock import tier_now
from tierstore.records.sweeps import since_sweep
from tierstore.tiers import Tier

LEFTOVER = "step_0009/g00000000001/r00000-0.distcp"
HOUR = 3600.0


def _tier(config: Config) -> Tier:
    tier: Tier = config.make_tiers(node=0)[0]
    return tier


def _age(tier: Tier, path: str, seconds: float) -> None:
    """Make ``path`` look ``seconds`` old on the tier's clock."""
    stamped = tier_now(tier) - seconds
    os.utime(tier.local_path(path), (stamped, stamped))  # type: ignore[attr-defined]


def _leave_a_leftover(tier: Tier) -> None:
    """Data no marker names, left alone for an hour: any sweep removes it."""
    tier.write_bytes(LEFTOVER, b"abandoned save")
    _age(tier, LEFTOVER, HOUR)
    _age(tier, "step_0009/g00000000001", HOUR)
    _age(tier, "step_0009", HOUR)


def _left(tier: Tier) -> bool:
    return Path(tier.local_path(LEFTOVER)).exists()  # type: ignore[attr-defined]


def test_a_restarted_promoter_counts_the_sweep_its_predecessor_finished(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("memory", promote={"stale_after": 1200})  # a sweep every 10 min
    tier = _tier(config)
    _leave_a_leftover(tier)
    Promoter(config).run_once()
    assert not _left(tier), "no sweep recorded: the first pass sweeps"
    since = since_sweep(tier)
    assert since is not None and 0 <= since < 5, "the sweep is recorded on the tier's clock"

    _leave_a_leftover(tier)
    Promoter(config).run_once()
    assert _left(tier), "a restart within 10 min of the last sweep does not sweep again"

    _age(tier, SWEPT_PATH, 601)
    Promoter(config).run_once()
    assert not _left(tier), "the last sweep 10 min old: due"


def test_gc_sweeps_whatever_the_record_says(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", promote={"stale_after": 1200})
    tier = _tier(config)
    Promoter(config).run_once()
    _leave_a_leftover(tier)
    promoter = Promoter(config)
    promoter.collect_garbage(dry_run=True)
    assert _left(tier)
    promoter.collect_garbage(dry_run=False)
    assert not _left(tier), "asked: swept"


def test_a_sweep_cut_short_is_not_recorded(make_config: Callable[..., Config]) -> None:
    """Only a sweep that ended counts: a dry run removes nothing and records nothing."""
    config = make_config("memory", promote={"stale_after": 1200})
    tier = _tier(config)
    Promoter(config).collect_garbage(dry_run=True)
    assert since_sweep(tier) is None
