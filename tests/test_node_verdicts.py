"""The processes of one node share their tier verdicts: one finds a tier away, the others skip it
at once, re-probe it about once a period between them, and ask it again once one finds it back.

Two :class:`TierHealth` views stand for two processes of a node (the view is all a process keeps);
the tier is a small stand-in whose cheap read hangs or answers as the test says. The real-process
restart is in ``tests/guarantees/test_tier_health.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tierstore._platform import node_verdicts
from tierstore._platform.health import RETRY_AFTER, TierHealth
from tierstore.errors import TierUnavailableError

TIMEOUT = 0.2


class Switchable:
    """A tier whose ``exists`` answers, or hangs until it is switched back."""

    name = "s3"
    health_key = "s3:http://127.0.0.1:1/bucket"

    def __init__(self) -> None:
        self.answers = threading.Event()
        self.answers.set()
        self.asked = 0

    def exists(self, path: str) -> bool:
        self.asked += 1
        self.answers.wait()
        return True


def found_away(view: TierHealth, tier: Switchable) -> None:
    """What a question that missed its deadline tells the view."""
    view.failed(tier, TierUnavailableError("no answer within 0.2s", tier=tier.name, outage=True))


def skipped_at_once(view: TierHealth, tier: Switchable) -> str:
    """The view skips ``tier`` without waiting; the message."""
    began = time.monotonic()
    with pytest.raises(TierUnavailableError) as caught:
        view.check(tier, TIMEOUT)
    assert time.monotonic() - began < TIMEOUT / 2
    return str(caught.value)


def test_another_process_skips_a_tier_one_found_away_without_asking_it() -> None:
    tier, first, second = Switchable(), TierHealth(), TierHealth()
    tier.answers.clear()
    found_away(first, tier)
    message = skipped_at_once(second, tier)
    assert f"found by process {os.getpid()} of this node" in message, message
    assert tier.asked == 0


def test_a_probe_that_finds_the_tier_back_reopens_it_for_the_whole_node() -> None:
    tier, first, second = Switchable(), TierHealth(), TierHealth()
    found_away(first, tier)
    skipped_at_once(second, tier)
    time.sleep(RETRY_AFTER)
    first.check(tier, TIMEOUT)  # its probe is due: the tier answers, the verdict goes
    assert not first.is_open(tier)
    second.check(tier, TIMEOUT)  # no probe of its own: a period has not passed since it opened
    assert not second.is_open(tier)
    assert tier.asked == 1


def test_the_node_reprobes_about_once_a_period_not_once_per_process() -> None:
    tier, first, second = Switchable(), TierHealth(), TierHealth()
    tier.answers.clear()
    found_away(first, tier)
    skipped_at_once(second, tier)
    time.sleep(RETRY_AFTER)
    with pytest.raises(TierUnavailableError):
        first.check(tier, TIMEOUT)  # its probe hangs past the deadline: the verdict is renewed
    assert tier.asked == 1
    skipped_at_once(second, tier)  # due by its own clock, but the node probed just now
    assert tier.asked == 1
    tier.answers.set()


def test_a_verdict_older_than_its_lifetime_is_not_read() -> None:
    tier, view = Switchable(), TierHealth()
    assert node_verdicts.write(tier.health_key, "no answer")
    path = next(node_verdicts.verdicts_dir().iterdir())
    stale = {**json.loads(path.read_text()), "at": time.time() - node_verdicts.TRUSTED_FOR - 1}
    path.write_text(json.dumps(stale))
    view.check(tier, TIMEOUT)  # a job long gone left it: the tier is asked
    assert not view.is_open(tier)


def test_without_a_usable_directory_each_process_keeps_its_own_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv(node_verdicts.DIR_ENV, str(blocked / "verdicts"))
    tier, first, second = Switchable(), TierHealth(), TierHealth()
    found_away(first, tier)
    assert first.is_open(tier)
    second.check(tier, TIMEOUT)
    assert not second.is_open(tier)
    skipped_at_once(first, tier)  # no verdict to miss: its own breaker holds until its probe
