"""Work bounded by its progress (``Prober.watch``): a listing that takes longer than the deadline
in all, but answers as it goes, is progress told from below the seam (``bounded.beat``), not a hung
tier; work that tells nothing for the deadline is one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tierstore._platform.bounded import Prober, beat, beats_here
from tierstore.config import config_from_dict
from tierstore.errors import TierUnavailableError
from tierstore.tiers import Tier

DEADLINE = 0.2
WALK_DEADLINE = 1.0
"""Longer than any gap a loaded machine puts between two directories (0.15 s was not, once; 0.5 s
was not, once in a full run's second worker beside multi-process tests: a descheduled thread or a
full collection of that worker's heap)."""
COUNT = 5_000
"""Checkpoint directories walked: 30 us each."""


def _tier(root: Path, name: str) -> Tier:
    spec = {"name": name, "type": "shared", "path": str(root)}
    return config_from_dict({"tiers": [spec]}).make_tiers(node=0)[0]


def test_work_that_beats_outlasts_the_deadline_and_silent_work_does_not(tmp_path: Path) -> None:
    tier = _tier(tmp_path, "beats")

    def steady(_progress: object) -> str:
        fanned = beats_here()  # told from a thread of its own, as marker reads are
        helper = threading.Thread(target=lambda: [fanned(1) or time.sleep(0.05) for _ in range(10)])
        helper.start()
        helper.join()
        for _ in range(10):
            beat()
            time.sleep(0.05)
        return "done"

    started = time.monotonic()
    assert Prober(DEADLINE).watch(tier, steady, what="list") == "done"
    assert time.monotonic() - started > 4 * DEADLINE

    silent = _tier(tmp_path, "silent")
    with pytest.raises(TierUnavailableError, match="no progress to list"):
        Prober(DEADLINE).watch(silent, lambda _progress: time.sleep(3 * DEADLINE), what="list")


@pytest.mark.slow  # 5,000 directories made, walked for 3 deadlines: 5 s
def test_a_directory_walk_longer_than_the_deadline_is_progress(tmp_path: Path) -> None:
    """Shared tiers' whole listings (cleanup's look) over many directories, each quick, walked again
    and again for three deadlines in one watched piece of work: never silent for one deadline."""
    root = tmp_path / "many"
    for i in range(COUNT):
        (root / f"c{i:05d}" / "g").mkdir(parents=True)
        (root / f"c{i:05d}" / "g" / "f").write_bytes(b"x")
    tier = _tier(root, "walked")

    def walks(_progress: object) -> int:
        started, count = time.monotonic(), 0
        while time.monotonic() - started < 3 * WALK_DEADLINE:
            assert len(tier.find("")) == COUNT
            count += 1
        return count

    assert Prober(WALK_DEADLINE).watch(tier, walks, what="list") >= 1
