"""Review of the sweep record (:mod:`tierstore.records.sweeps`): a record stamped ahead of the
tier's clock now (a tier whose clock was stepped back since, or a tier copied with its times from
a host ahead) tells of no sweep that has ended; it must not put the next sweep off by that much."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

import pytest

from tests.promote.test_sweeps import _age, _leave_a_leftover, _left, _tier
from tierstore.config import Config
from tierstore.ids import SWEPT_PATH
from tierstore.promote.sidecar import Promoter
from tierstore.records.sweeps import record_sweep, since_sweep

DAY = 86400.0


def test_a_sweep_record_from_the_future_does_not_put_the_sweep_off(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("memory", promote={"stale_after": 1200})  # a sweep every 10 min
    tier = _tier(config)
    record_sweep(tier)
    _age(tier, SWEPT_PATH, -DAY)  # stamped a day ahead of the tier's clock now
    _leave_a_leftover(tier)
    Promoter(config).run_once()
    assert not _left(tier), "no sweep can have ended in the future: the sweep is due"


def test_a_sweep_whose_removal_failed_is_not_recorded(make_config: Callable[..., Config]) -> None:
    """A removal that failed leaves the sweep incomplete: a restarted promoter sweeps again at once."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    config = make_config("memory", promote={"stale_after": 1200})
    tier = _tier(config)
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
