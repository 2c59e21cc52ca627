"""A pass sweeps a tier for leftovers when its last complete sweep, by this promoter or the one
before it, is ``min(stale_after / 2, 10 min)`` old (:mod:`tierstore.records.sweeps`): a restarted
promoter does not list every retained checkpoint again at once; ``tierstore gc`` always sweeps. A
record stamped ahead of the tier's clock (a clock stepped back since) tells of no sweep, and a sweep
whose removal failed is not recorded."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tierstore.config import Config
from tierstore.ids import SWEPT_PATH
from tierstore.promote.sidecar import Promoter
from tierstore.records.clock import tier_now
from tierstore.records.sweeps import record_sweep, since_sweep
from tierstore.tiers import Tier

LEFTOVER = "step_0009/g00000000001/r00000-0.distcp"
HOUR = 3600.0
DAY = 86400.0


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


def _swept_every_ten_minutes(make_config: Callable[..., Config]) -> tuple[Config, Tier]:
    """A memory tier whose promoter sweeps every 10 min (``stale_after`` 20 min)."""
    config = make_config("memory", promote={"stale_after": 1200})
    return config, _tier(config)


def _left(tier: Tier) -> bool:
    return Path(tier.local_path(LEFTOVER)).exists()  # type: ignore[attr-defined]


def test_a_restarted_promoter_counts_the_sweep_its_predecessor_finished(
    make_config: Callable[..., Config],
) -> None:
    config, tier = _swept_every_ten_minutes(make_config)
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
    config, tier = _swept_every_ten_minutes(make_config)
    Promoter(config).run_once()
    _leave_a_leftover(tier)
    promoter = Promoter(config)
    promoter.collect_garbage(dry_run=True)
    assert _left(tier)
    promoter.collect_garbage(dry_run=False)
    assert not _left(tier), "asked: swept"


def test_a_sweep_cut_short_is_not_recorded(make_config: Callable[..., Config]) -> None:
    """Only a sweep that ended counts: a dry run removes nothing and records nothing."""
    config, tier = _swept_every_ten_minutes(make_config)
    Promoter(config).collect_garbage(dry_run=True)
    assert since_sweep(tier) is None


def test_a_sweep_record_from_the_future_does_not_put_the_sweep_off(
    make_config: Callable[..., Config],
) -> None:
    config, tier = _swept_every_ten_minutes(make_config)
    record_sweep(tier)
    _age(tier, SWEPT_PATH, -DAY)  # stamped a day ahead of the tier's clock now
    _leave_a_leftover(tier)
    Promoter(config).run_once()
    assert not _left(tier), "no sweep can have ended in the future: the sweep is due"


def test_a_sweep_whose_removal_failed_is_not_recorded(make_config: Callable[..., Config]) -> None:
    """A removal that failed leaves the sweep incomplete: a restarted promoter sweeps again at once."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    config, tier = _swept_every_ten_minutes(make_config)
    _leave_a_leftover(tier)
    held = tier.local_path("step_0009")  # type: ignore[attr-defined]
    subprocess.run(["mount", "--bind", held, held], check=True)  # read-only there: EROFS
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", held], check=True)
        Promoter(config).run_once()
        assert _left(tier), "the removal failed"
    finally:
        subprocess.run(["umount", held], check=True)
    assert since_sweep(tier) is None, "a sweep that left a leftover it meant to remove is not complete"
    Promoter(config).run_once()
    assert not _left(tier), "the restarted promoter sweeps again at once"
