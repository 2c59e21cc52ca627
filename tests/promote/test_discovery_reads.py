"""A promoter's look at a tier reads the markers its cache cannot serve many at a time where each
read is a round trip (S3): the same copies as one at a time, a damaged marker skipped and named."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.simulated_job import manifest_for
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.promote.discovery import MarkerCache, discover
from tierstore.signing import MarkerTrust


def test_markers_read_many_at_a_time_give_the_copies_and_name_a_damaged_one(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config("s3")
    (s3,) = config.make_tiers(node=0)
    for index in range(1, 41):
        manifest = manifest_for(index, 2, "")
        s3.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
    s3.write_bytes(marker_path("broken_1"), b"{not json")
    with caplog.at_level(logging.WARNING, logger="tierstore.promote.discovery"):
        seen = discover(s3, MarkerCache(MarkerTrust()))
    assert sorted(seen) == sorted(manifest_for(i, 2, "").checkpoint_id for i in range(1, 41))
    assert all(seen[c].copy.seq == int(c[5:]) // 100 for c in seen)
    assert "ignoring marker broken_1 in tier" in caplog.text
