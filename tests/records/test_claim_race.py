"""Commit numbers are taken exclusively per tier, whatever the ids: writers of different ids
claiming at once in one tier get distinct numbers (found in review: the create-only entry was named
by number, id and generation, so writers of different ids never collided and six of 16 took 1)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import pytest

from tests.local_files import real_path
from tests.s3server import SeaweedServer
from tierstore.config import Config, config_from_dict
from tierstore.ids import void_entry_path
from tierstore.promote.cleanup import find_leftovers
from tierstore.promote.sidecar import Promoter
from tierstore.records.log import highest_in
from tierstore.records.protocol import claim
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier


def _sixteen_claims_at_once(tier: Tier) -> None:
    start = threading.Barrier(16)
    taken: list[int] = []

    def writer(index: int) -> None:
        start.wait()
        taken.append(claim(tier, f"c{index}", f"g{index:019x}"))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(taken) == list(range(1, 17)), sorted(taken)
    assert highest_in(tier) == 16


def test_writers_of_different_ids_claiming_at_once_take_distinct_numbers(
    make_config: Callable[..., Config],
) -> None:
    (tier,) = make_config("shared").make_tiers(node=0)
    _sixteen_claims_at_once(tier)


def test_the_same_on_a_real_s3_server(seaweed: SeaweedServer, seaweed_bucket: str) -> None:
    """Through conditional PUTs (``If-None-Match: *``), which moto does not referee under a race
    (FACTS.md) but SeaweedFS does; a 412 to a retried PUT is told apart from the writer's own first
    attempt by the void entry's body, which names the claimant."""
    config = config_from_dict(
        {
            "tiers": [
                {
                    "name": "s3",
                    "type": "s3",
                    "url": f"s3://{seaweed_bucket}/run",
                    "endpoint_url": seaweed.endpoint,
                }
            ]
        }
    )
    _sixteen_claims_at_once(config.make_tiers(node=0)[0])


def test_a_claims_number_stays_taken_until_stale_then_gc_removes_it_quietly(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    """Each claim leaves its number's void entry. It must outlive a racing claimant's look (gc
    leaves it for ``stale_after``), the highest one stays as the sequence's high-water mark, and
    removing the others is bookkeeping, not an INFO line per commit in the promoter's log."""
    config = make_config("shared", promote={"stale_after": "1h"})
    (tier,) = config.make_tiers(node=0)
    for index in range(3):
        claim(tier, f"c{index}", f"g{index:019x}")
    voids = [void_entry_path(seq) for seq in (1, 2, 3)]
    assert all(tier.exists(path) for path in voids)
    assert [
        c.path
        for c in find_leftovers(tier, stale_after=3600, activity_ttl=60, trust=MarkerTrust())
        if c.path in voids
    ] == []
    hour_ago = time.time() - 3601
    for path in voids:
        os.utime(str(real_path(tier, path)), (hour_ago, hour_ago))
    stale = [c.path for c in find_leftovers(tier, stale_after=3600, activity_ttl=60, trust=MarkerTrust())]
    assert [p for p in stale if p in voids] == voids[:2], "the highest number stays"
    with caplog.at_level(logging.INFO, logger="tierstore.promote.sidecar"):
        Promoter(config).collect_garbage(dry_run=False)
    assert not tier.exists(voids[0]) and not tier.exists(voids[1]) and tier.exists(voids[2])
    assert "void" not in caplog.text, caplog.text
    assert highest_in(tier) == 3
