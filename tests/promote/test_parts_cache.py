"""The promoter's cache of part records (``MarkerCache.parts``): an idle pass reads no record again,
yet every change a writer, a confirmation or a drop makes is seen at the next look once settled."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tierstore.config import Config
from tierstore.ids import checkpoint_file, generation_dir, rank_part_path
from tierstore.promote import discovery
from tierstore.promote.discovery import SETTLE, MarkerCache
from tierstore.records.marker import FileEntry
from tierstore.records.parts import PartRecord
from tierstore.records.protocol import confirm_part
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

GEN_A = "g0000000000010000000"
GEN_B = "g0000000000020000000"


def _write_part(tier: Tier, generation: str, rank: int, seq: int) -> None:
    entry = FileEntry(f"{generation}/r{rank:05d}-0.distcp", 8, 0, rank, 1)
    tier.write_bytes(checkpoint_file("x", entry.path), b"12345678")
    record = PartRecord("x", generation, 1, (rank,), (entry,), seq=seq, node_ranks=(1, 2))
    tier.write_bytes(rank_part_path("x", generation, rank), record.to_json())


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Moves this process's monotonic clock on past :data:`SETTLE` (the cache's trust rule)."""
    offset = [0.0]
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + offset[0])

    def step() -> None:
        offset[0] += SETTLE + 1

    yield step


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every reading of an id's part records from the tier (the cache's misses)."""
    seen: list[str] = []
    real = discovery.part_records

    def counted(tier: Tier, checkpoint_id: str) -> dict[str, list[PartRecord]]:
        seen.append(checkpoint_id)
        return real(tier, checkpoint_id)

    monkeypatch.setattr(discovery, "part_records", counted)
    return seen


def _settled(tier: Tier, later: Callable[[], None]) -> MarkerCache:
    cache = MarkerCache(MarkerTrust())
    cache.parts(tier, "x")
    later()
    cache.parts(tier, "x")  # read well after the directories' times were first seen
    return cache


def _seqs(cache: MarkerCache, tier: Tier) -> dict[str, list[int | None]]:
    return {g: [r.seq for r in records] for g, records in cache.parts(tier, "x").items()}


def test_unchanged_records_are_served_from_the_cache_once_settled(
    make_config: Callable[..., Config], later: Callable[[], None], reads: list[str]
) -> None:
    tier = make_config("memory").make_tiers(node=1)[0]
    _write_part(tier, GEN_A, 1, 3)
    cache = MarkerCache(MarkerTrust())
    assert _seqs(cache, tier) == {GEN_A: [3]}
    assert _seqs(cache, tier) == {GEN_A: [3]} and len(reads) == 2, "not settled yet: read again"
    later()
    assert _seqs(cache, tier) == {GEN_A: [3]} and len(reads) == 3
    assert _seqs(cache, tier) == {GEN_A: [3]} and len(reads) == 3, "settled: from the cache"


@pytest.mark.parametrize(
    "change", ["confirmed", "rank added", "record dropped", "new generation", "generation dropped"]
)
def test_every_change_to_the_records_is_seen_at_the_next_look(
    change: str, make_config: Callable[..., Config], later: Callable[[], None], reads: list[str]
) -> None:
    tier = make_config("memory").make_tiers(node=1)[0]
    _write_part(tier, GEN_A, 1, 3)
    cache = _settled(tier, later)
    expected: dict[str, list[int | None]]
    if change == "confirmed":
        assert confirm_part(tier, "x", GEN_A, 5)
        expected = {GEN_A: [5]}
    elif change == "rank added":
        _write_part(tier, GEN_A, 2, 3)
        expected = {GEN_A: [3, 3]}
    elif change == "record dropped":
        tier.delete(rank_part_path("x", GEN_A, 1))
        expected = {}
    elif change == "new generation":
        _write_part(tier, GEN_B, 1, 4)
        expected = {GEN_A: [3], GEN_B: [4]}
    else:
        tier.delete_tree(generation_dir("x", GEN_A))
        expected = {}
    before = len(reads)
    assert _seqs(cache, tier) == expected
    assert len(reads) == before + 1, "the change was read from the tier"
