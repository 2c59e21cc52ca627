"""Cleanup of a job-wide tier takes markers from its keeper's marker cache only where the cache
trusts them at the mtime cleanup's own marker listing shows (promote/cleanup.py ``find_leftovers``),
counted at the S3 server: a keeper's cleanup over retained checkpoints reads no marker once its cache
has them settled; a marker replaced since the cache read it is read again, and its new generation is
never taken for a leftover."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.promote.test_keeper_index_costs import NAMESPACE, _commit, _config, _marker_reads
from tests.request_counter import CountingS3
from tests.simulated_job import layout, manifest_for
from tierstore.config import Config
from tierstore.ids import generation_dir, marker_path
from tierstore.promote.cleanup import find_leftovers, remove
from tierstore.promote.discovery import SETTLE
from tierstore.promote.sidecar import Promoter
from tierstore.records.catalog import marker_times
from tierstore.records.changes import touch
from tierstore.records.clock import tier_now
from tierstore.records.marker import read_manifest
from tierstore.tiers import Tier
from tierstore.topology import HOST_VARIABLE


def _settled_keeper(
    s3: CountingS3, root: Path, name: str, retained: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Config, Tier, Promoter]:
    """A keeper of S3 holding ``retained`` checkpoints, whose marker cache has every marker settled:
    its first pass read them (cleanup too), its second, :data:`SETTLE` s later, read them again
    (that first pass restamped S3: listed again). The lease outlasts the test's waits."""
    config = _config(s3, root, name)
    config = config.model_copy(update={"promote": config.promote.model_copy(update={"keeper_lease": 600.0})})
    tier = config.make_tiers(node=0)[2]
    _commit(tier, *range(1, retained + 1))
    monkeypatch.setenv(HOST_VARIABLE, "host0")
    keeper = Promoter(config, node=0)
    keeper.run_once()
    time.sleep(SETTLE + 0.1)
    keeper.run_once()
    assert keeper.context.keepers.kept() == {"s3"}
    return config, tier, keeper


@pytest.mark.slow  # ~6 s: two keeper passes SETTLE s apart, then two cleanups over 30 retained in S3
def test_a_keepers_cleanup_reads_no_marker_its_cache_has_settled(
    counted_s3: CountingS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper's next cleanup over N retained lists the tier afresh and reads none of the N
    markers; a marker replaced since (another mtime) is the one it reads."""
    retained = 30
    _, s3, keeper = _settled_keeper(counted_s3, tmp_path, "cleanup-reads", retained, monkeypatch)
    with counted_s3.counting(by_key=True) as keyed, counted_s3.counting() as seen:
        assert keeper.collect_garbage(dry_run=False) == []
    assert _marker_reads(keyed.by_operation) == {}, keyed.by_operation
    assert seen.by_operation["GET list"] > 0, "the tier is listed afresh"

    replaced = manifest_for(7, 1, NAMESPACE).with_changes(timings={"started_at": 42.0})
    s3.write_bytes(marker_path(replaced.checkpoint_id), replaced.to_json())  # seconds later: another mtime
    with counted_s3.counting(by_key=True) as keyed:
        assert keeper.collect_garbage(dry_run=False) == []
    assert _marker_reads(keyed.by_operation) == {replaced.checkpoint_id: 1}, keyed.by_operation


def test_cleanup_reads_a_marker_replaced_since_its_cache_read_it_and_keeps_the_new_generation(
    counted_s3: CountingS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An overwrite publishes a new generation and a new marker after the keeper's cache settled the
    old one: cleanup, whose marker listing shows the new mtime, reads the new marker. However old
    its files look, the new generation is never a leftover (taken from the cache at the old mtime,
    the old marker would leave it unnamed); the old one is, only once stale, and goes."""
    _, s3, keeper = _settled_keeper(counted_s3, tmp_path, "cleanup-overwrite", 3, monkeypatch)
    cache, trust = keeper.context.cache, keeper.context.trust
    old = manifest_for(2, 1, NAMESPACE)
    assert cache.trusted(s3, old.checkpoint_id, marker_times(s3)[old.checkpoint_id]), "settled"

    new = manifest_for(2, 1, NAMESPACE, seq=4).with_changes(overwrite=True)
    for path, data in layout(new):  # the marker last, as a save publishes it
        s3.write_bytes(path, data)
    touch(s3)
    later = tier_now(s3) + 3600.0  # every file, the new generation's too, an hour untouched
    with counted_s3.counting(by_key=True) as keyed:
        stale = find_leftovers(s3, trust=trust, stale_after=600.0, activity_ttl=60.0, now=later, cache=cache)
    trees = {c.path for c in stale if c.kind == "tree"}
    assert trees == {generation_dir(old.checkpoint_id, old.generation)}, stale
    assert _marker_reads(keyed.by_operation) == {old.checkpoint_id: 1}, "the new marker is read"

    fresh = find_leftovers(s3, trust=trust, stale_after=600.0, activity_ttl=60.0, cache=cache)
    assert [c for c in fresh if c.kind == "tree"] == [], "the old generation is not stale yet"

    for cleanup in stale:
        remove(s3, cleanup, trust=trust)
    assert read_manifest(s3, new.checkpoint_id, trust=trust).generation == new.generation
    assert all(s3.exists(path) for path, _ in layout(new)), "the new generation stays whole"
    assert not s3.find(generation_dir(old.checkpoint_id, old.generation)), "the old one is gone"
