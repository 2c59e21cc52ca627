"""Ages are taken on the tier's clock: this process's clock, however far off, changes no verdict.

The real skew (other processes under ``faketime``) is in tests/guarantees/test_clock_skew.py; here
this process's ``time.time()`` is moved, which the tier's file times do not follow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from tierstore.config import Config
from tierstore.ids import (
    CLOCK_DIR,
    checkpoint_file,
    clock_probe_path,
    generation_dir,
    marker_path,
    rank_part_path,
    sighting_path,
)
from tierstore.promote import discovery
from tierstore.promote.cleanup import find_leftovers
from tierstore.promote.discovery import SETTLE, SETTLED_AGE, MarkerCache, discover
from tierstore.records.activity import held, live
from tierstore.records.catalog import marker_times
from tierstore.records.clock import tier_now
from tierstore.records.marker import FileEntry
from tierstore.records.parts import PartRecord
from tierstore.records.sightings import Sighting, read_sightings, record_sighting, trusted
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

GEN = "g0000000000010000000"


def memory_tier(make_config: Callable[..., Config]) -> Tier:
    tier: Tier = make_config("memory").make_tiers(node=0)[0]
    return tier


@pytest.mark.parametrize("skew", [2 * 3600.0, -2 * 3600.0, 86400.0])
def test_live_work_stays_live_whatever_this_host_clock_says(
    skew: float, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = memory_tier(make_config)
    tier.write_bytes(f"{generation_dir('step_1', GEN)}/r00000-0.distcp", b"x" * 64)
    with held(tier, "write", "step_1", GEN):
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + skew)
        assert abs(tier_now(tier) - real()) < 5, "the tier's clock, not this process's"
        assert [r.checkpoint_id for r in live(tier)] == ["step_1"]
        assert find_leftovers(tier, stale_after=600.0, activity_ttl=60.0, trust=MarkerTrust()) == []


def test_a_probe_leaves_nothing_and_a_left_one_is_cleaned_up(make_config: Callable[..., Config]) -> None:
    tier = memory_tier(make_config)
    tier_now(tier)
    assert tier.find(CLOCK_DIR) == []
    left = clock_probe_path("host~123~abc")  # a process that died between write and delete
    tier.write_bytes(left, b"")
    assert find_leftovers(tier, stale_after=600.0, activity_ttl=60.0, trust=MarkerTrust()) == [], (
        "it may be at work"
    )
    path = tier.local_path(left)
    assert path is not None
    os.utime(path, (time.time() - 61, time.time() - 61))
    (cleanup,) = find_leftovers(tier, stale_after=600.0, activity_ttl=60.0, trust=MarkerTrust())
    assert cleanup.path == left


def test_a_sighting_is_as_old_as_its_record_whatever_the_promoter_clock_wrote_in_it(
    make_config: Callable[..., Config],
) -> None:
    """A promoter two hours ahead stamps ``seen_at`` two hours into the future; a restore must not
    trust that sighting for two more hours once the promoter has stopped writing it."""
    tier = memory_tier(make_config)
    record_sighting(tier, Sighting("s3", 7, {"a": (7, GEN)}, seen_at=time.time() + 7200))
    path = tier.local_path(sighting_path("s3"))
    assert path is not None
    os.utime(path, (time.time() - 100, time.time() - 100))  # the promoter stopped 100 s ago
    (sighting,) = read_sightings(tier).values()
    assert abs(sighting.seen_at - (time.time() - 100)) < 5
    assert trusted(read_sightings(tier), max_age=30.0) == {}


def test_a_part_waiting_for_promotion_is_as_old_as_its_record_not_its_writer_clock(
    make_config: Callable[..., Config],
) -> None:
    """Node 1's part of a save coordinated elsewhere, written by a trainer two hours behind: it is
    held for promotion ``stale_after`` from when it was written, not two hours less."""
    tier = make_config("memory").make_tiers(node=1)[0]
    entry = FileEntry(f"{GEN}/r00001-0.distcp", 8, 0, 1, 1)
    tier.write_bytes(checkpoint_file("x", entry.path), b"12345678")
    record = PartRecord("x", GEN, 1, (1,), (entry,), seq=3, node_ranks=(1,), written_at=time.time() - 7200)
    tier.write_bytes(rank_part_path("x", GEN, 1), record.to_json())
    (seen,) = discover(tier, MarkerCache(MarkerTrust())).values()
    assert seen.copy.partial
    assert abs(seen.copy.committed_at - time.time()) < 5


def test_a_marker_is_trusted_from_the_cache_only_once_read_well_after_it_was_listed(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Times may be whole seconds: a marker replaced within the second keeps its mtime. This host
    two hours ahead of the tier must not take a marker written just now for a settled one."""
    tier = memory_tier(make_config)
    reads: list[str] = []
    monkeypatch.setattr(
        discovery, "read_manifest", lambda _tier, cid, trust: reads.append(cid) or f"read {len(reads)}"
    )
    real_time, real_monotonic = time.time, time.monotonic
    monkeypatch.setattr(time, "time", lambda: real_time() + 7200)
    cache, mtime = MarkerCache(MarkerTrust()), real_time()  # the tier stamps the marker now
    assert cache.read(tier, "x", mtime) == "read 1"
    assert cache.read(tier, "x", mtime) == "read 2", "maybe replaced within the second: read again"
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + SETTLE + 1)
    assert cache.read(tier, "x", mtime) == "read 3"
    assert cache.read(tier, "x", mtime) == "read 3", "read long after it was listed: settled"


def _old_marker(tier: Tier, index: int, age: float) -> float:
    """Commit a copy in ``tier`` whose marker the tier stamped ``age`` s ago; its mtime."""
    from tests.simulated_job import layout, manifest_for

    manifest = manifest_for(index, 1, "ns")
    for path, data in layout(manifest):
        tier.write_bytes(path, data)
    marker = tier.local_path(marker_path(manifest.checkpoint_id))  # type: ignore[attr-defined]
    stamped = tier_now(tier) - age
    os.utime(marker, (stamped, stamped))
    return marker_times(tier)[manifest.checkpoint_id]


def test_an_old_marker_is_settled_by_its_first_read_on_the_tier_clock(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new promoter's first pass over a long-retained checkpoint counts its read: the tier's clock,
    probed before the read, is :data:`SETTLED_AGE` past the marker's mtime. A marker the tier
    stamped just now is not settled by one read, even when this host's clock is two hours ahead
    (it must not stand in for the tier's)."""
    tier = memory_tier(make_config)
    old = _old_marker(tier, 1, SETTLED_AGE + 5)
    young = _old_marker(tier, 2, 0.0)
    ids = {"step_00000100": old, "step_00000200": young}
    cache = MarkerCache(MarkerTrust())
    cache.read_all(tier, ids)
    assert cache.trusted(tier, "step_00000100", old), "old enough on the tier's clock: settled at once"
    assert not cache.trusted(tier, "step_00000200", young), "stamped now: maybe replaced in the second"
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 2 * 3600)
    ahead = MarkerCache(MarkerTrust())
    ahead.read_all(tier, ids)
    assert not ahead.trusted(tier, "step_00000200", young), "this host's clock says old; the tier's says not"
    assert ahead.trusted(tier, "step_00000100", old)
    assert tier.find(CLOCK_DIR) == [], "the probe is gone"
