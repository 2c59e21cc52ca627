"""A job-wide tier's index (records/index.py): what is written is what is read back, and an index
that cannot be used (absent, damaged, another format) is no index: the reader lists the tier."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable

import pytest

from tierstore.config import Config
from tierstore.ids import INDEX_PATH
from tierstore.records.conflicts import Conflict
from tierstore.records.index import Index, IndexedCopy, decode, encode, read_index, write_index

COPIES = (
    IndexedCopy("step_1", 1, 1, 1e9, "g1", started_at=1e9 - 5),
    IndexedCopy("step_2", None, None, 2e9, "g2", "fast", True, ("pfs", "s3")),
    IndexedCopy("x", 7, 3, 0.5, "g3", overwrite=False),
    IndexedCopy("step_4", 4, 4, 4e9, "g4", marker_mtime=1.7e9),
)
CONFLICT = Conflict("step_2", "g2", 2, "s3", "g9", 9, "raced", detected_at=12.5)


@pytest.mark.parametrize(
    "index",
    [
        Index(None, 0, (), ()),
        Index(b"\x00\xffab", 7, (CONFLICT,), COPIES),
        Index(b"token", 3, (), COPIES[:1]),
    ],
)
def test_an_index_reads_back_as_written(index: Index) -> None:
    assert decode(encode(index)) == index


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"not compressed",
        zlib.compress(b"{not json"),
        zlib.compress(b"[]"),
        zlib.compress(json.dumps({"format": "tierstore.index/2", "token": None}).encode()),
        zlib.compress(json.dumps({"format": "tierstore.index/1", "token": None}).encode()),
        zlib.compress(
            json.dumps(
                {"format": "tierstore.index/1", "token": "zz", "highest": 1, "conflicts": [], "copies": []}
            ).encode()
        ),
        zlib.compress(
            json.dumps(
                {"format": "tierstore.index/1", "token": None, "highest": 1, "conflicts": [], "copies": [[1]]}
            ).encode()
        ),
    ],
)
def test_a_damaged_or_unknown_index_is_refused(blob: bytes) -> None:
    with pytest.raises(ValueError):
        decode(blob)


def test_an_index_written_without_marker_times_reads_as_unknown_times() -> None:
    """An index of the release before marker times: its rows are one field shorter; every marker
    then counts as not known to its writer (a keeper reads it)."""
    row = ["step_1", 1, 1, 1e9, "g1", "", None, [], None]
    body = {"format": "tierstore.index/1", "token": "74", "highest": 1, "conflicts": [], "copies": [row]}
    index = decode(zlib.compress(json.dumps(body).encode()))
    assert index.copies == (IndexedCopy("step_1", 1, 1, 1e9, "g1"),)
    assert index.copies[0].marker_mtime is None


def test_a_tier_without_a_usable_index_has_none(make_config: Callable[..., Config]) -> None:
    (tier,) = make_config("shared").make_tiers(node=0)
    assert read_index(tier) is None
    write_index(tier, Index(b"t", 2, (CONFLICT,), COPIES))
    assert read_index(tier) == Index(b"t", 2, (CONFLICT,), COPIES)
    tier.write_bytes(INDEX_PATH, b"damaged")
    assert read_index(tier) is None


def test_an_index_of_ten_thousand_copies_stays_small() -> None:
    """What 1,250 nodes GET after each change: compact, not one marker's worth per copy."""
    copies = tuple(
        IndexedCopy(
            f"step_{i:08d}", i, i, 1.7e9 + i, f"g{i:011x}00000000", "fast", None, (), 1.7e9, 1.7e9 + i
        )
        for i in range(10_000)
    )
    assert len(encode(Index(b"t" * 32, 10_000, (), copies))) < 200_000
