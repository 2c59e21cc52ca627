"""What the keeper's index of a job-wide tier saves (records/index.py), counted at the S3 server:

* a node that does not keep S3 and whose retention deletes in its own node-local tier decides on
  the index made under the stamp it reads, not on a listing of S3 (promote/view.py, ``full``);
* a keeper's first pass over the tier reads only the markers its previous keeper's index does not
  hold settled at the mtime listed (promote/discovery.py ``MarkerCache.seed``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.request_counter import CountingS3, FileOps
from tests.simulated_job import layout, manifest_for
from tierstore.config import Config, config_from_dict
from tierstore.ids import INDEX_PATH, MARKER_NAME, marker_path
from tierstore.promote.discovery import SETTLE
from tierstore.promote.sidecar import Promoter
from tierstore.records.changes import touch
from tierstore.records.index import read_index
from tierstore.tiers import Tier
from tierstore.topology import HOST_VARIABLE

NAMESPACE = "job"
LEASE = 4.0
"""Seconds of the keeper's lease: its thread renews it every third, a watcher reads it every two
thirds; a keeper stalled for two thirds would be taken over."""


def _config(s3: CountingS3, root: Path, name: str) -> Config:
    """Two node-local tiers per simulated node (``nvme`` keeps one checkpoint) and S3."""
    import boto3

    boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket=name)
    return config_from_dict(
        {
            "namespace": NAMESPACE,
            "promote": {"interval": "1h", "keeper_lease": f"{LEASE}s"},
            "tiers": [
                {"name": "ram", "type": "memory", "path": str(root / name / "ram" / "{node}")},
                {"name": "nvme", "type": "local", "path": str(root / name / "nvme" / "{node}"), "keep": 1},
                {"name": "s3", "type": "s3", "url": f"s3://{name}/ts", "endpoint_url": s3.endpoint},
            ],
        }
    )


def _promoters(config: Config, monkeypatch: pytest.MonkeyPatch) -> tuple[Promoter, Promoter]:
    """The promoters of nodes 0 and 1, each on a host of its own: in one process, a lease holder
    on the same host would look like this very process restarted, and be taken over at once."""
    promoters = []
    for node in (0, 1):
        monkeypatch.setenv(HOST_VARIABLE, f"host{node}")
        promoters.append(Promoter(config, node=node))
    return promoters[0], promoters[1]


def _commit(tier: Tier, *indexes: int) -> list[str]:
    """Committed copies of checkpoints ``indexes`` in ``tier`` (files, marker, log entry), then the
    stamp, as a save or promotion leaves them; their ids."""
    for index in indexes:
        for path, data in layout(manifest_for(index, 1, NAMESPACE)):
            tier.write_bytes(path, data)
    touch(tier)
    return [manifest_for(index, 1, NAMESPACE).checkpoint_id for index in indexes]


def _lists(seen: dict[str, int]) -> int:
    return sum(n for op, n in seen.items() if op == "GET list")


@pytest.mark.slow  # ~20 s: two leases waited out
def test_retention_on_a_node_that_does_not_keep_s3_decides_on_the_index_not_a_listing(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 keeps one checkpoint in its local disk tier; node 0 keeps S3. After a change in S3
    that the keeper indexed, node 1's pass whose retention deletes in its own tier (its first look
    reused a listing: retention looks again, ``full``) reads S3's stamp and the index made under
    it, and lists nothing in S3. When the index is behind the stamp, that look lists S3 and
    deletes on the listing, never on the listing it kept."""
    config = _config(counted_s3, tmp_path, "full-look")
    s3 = config.make_tiers(node=0)[2]
    _ram, nvme, _ = config.make_tiers(node=1)
    keeper, watcher = _promoters(config, monkeypatch)
    _commit(s3, 1)
    first = _commit(nvme, 1)[0]
    keeper.run_once()
    stop = keeper.context.keepers.start()  # renews the lease, naming the stamp it read
    try:
        keeper.run_once()  # its first pass restamped S3: listed and indexed again
        watcher.run_once()  # it finds the lease: watched once a renewal names the stamp
        time.sleep(LEASE)
        watcher.run_once()
        assert set(watcher.context.keepers.watched()) == {"s3"}, "node 0 keeps S3"

        _commit(s3, 2, 3)  # a change in S3 ...
        keeper.run_once()  # ... that its keeper indexed
        second = _commit(nvme, 2)[0]  # a save on node 1 beyond what its disk tier keeps
        time.sleep(LEASE)  # node 1 reads a lease naming the changed stamp
        file_ops.roots = (str(tmp_path / "full-look" / "ram" / "1"),)
        with counted_s3.counting() as seen, file_ops.window() as ram:
            report = watcher.run_once()
        assert [(d.tier, d.checkpoint_id) for d in report.deleted] == [("nvme", first)]
        assert ram.by_operation["os.scandir"] + ram.by_operation["os.listdir"] > 0, (
            "retention looked at every tier again (its first look reused the empty ram tier's listing)"
        )
        assert _lists(seen.by_operation) == 0, seen.by_operation
        assert set(watcher.view.found["s3"]) == {
            manifest_for(i, 1, NAMESPACE).checkpoint_id for i in (1, 2, 3)
        }

        newest = _commit(s3, 4)[0]  # a change in S3 its keeper has not indexed yet
        _commit(nvme, 3)
        with counted_s3.counting() as seen:
            report = watcher.run_once()
        assert [(d.tier, d.checkpoint_id) for d in report.deleted] == [("nvme", second)]
        assert _lists(seen.by_operation) > 0, "the index is behind the stamp: S3 is listed"
        assert newest in watcher.view.found["s3"] and "s3" not in watcher.view.reused
    finally:
        stop()


def _marker_reads(seen: dict[str, int]) -> dict[str, int]:
    """The marker GETs among requests counted by key: ``{id: GETs}``."""
    suffix = f"/{MARKER_NAME}"
    return {k.rsplit("/", 2)[-2]: n for k, n in seen.items() if k.startswith("GET ") and k.endswith(suffix)}


def _first_pass(
    config: Config, s3: CountingS3, node: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Promoter, dict[str, int]]:
    """A keeper's first look on ``node`` (a host of its own) once the previous keeper let go, and
    the markers it read (GETs by id); then it lets go too."""
    monkeypatch.setenv(HOST_VARIABLE, f"host{node}")
    keeper = Promoter(config, node=node)
    with s3.counting(by_key=True) as seen:
        keeper.look()
    assert keeper.context.keepers.kept() == {"s3"}
    keeper.context.keepers.release()
    return keeper, _marker_reads(seen.by_operation)


@pytest.mark.slow  # ~15 s: a hundred markers read by five keepers in turn
def test_a_keepers_first_pass_reads_only_the_markers_its_predecessors_index_does_not_hold(
    counted_s3: CountingS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keeper taking over S3 (start-up, takeover) with its predecessor's index reads, at its
    first look, only the marker replaced since (another mtime); with an index damaged, absent, or
    whose writer had not yet read its markers :data:`SETTLE` s after listing them (a marker
    replaced within the second keeps its mtime), it reads every marker, as before the index."""
    retained = 100
    config = _config(counted_s3, tmp_path, "first-pass")
    s3 = config.make_tiers(node=0)[2]
    objects = [
        (f"ts/{NAMESPACE}/{path}", data)
        for index in range(1, retained + 1)
        for path, data in layout(manifest_for(index, 1, NAMESPACE))
    ]
    counted_s3.put_direct("first-pass", objects)
    everything = {manifest_for(i, 1, NAMESPACE).checkpoint_id for i in range(1, retained + 1)}

    _, reads = _first_pass(config, counted_s3, 0, monkeypatch)
    assert reads == dict.fromkeys(everything, 1), "no index yet: every marker is read"
    unsettled = read_index(s3)
    assert unsettled is not None and all(c.marker_mtime is None for c in unsettled.copies)

    monkeypatch.setenv(HOST_VARIABLE, "host0")
    previous = Promoter(config, node=0)  # the keeper that settles what it read, and indexes it
    previous.run_once()
    time.sleep(SETTLE + 0.1)
    previous.run_once()  # its first pass restamped S3: listed again, each marker read again
    previous.context.keepers.release()
    index = read_index(s3)
    assert index is not None and all(c.marker_mtime is not None for c in index.copies)
    replaced = manifest_for(7, 1, NAMESPACE).with_changes(timings={"started_at": 42.0})
    s3.write_bytes(marker_path(replaced.checkpoint_id), replaced.to_json())  # seconds later: another mtime
    touch(s3)

    seeded, reads = _first_pass(config, counted_s3, 1, monkeypatch)
    assert reads == {replaced.checkpoint_id: 1}, reads
    found = seeded.view.found["s3"]
    assert set(found) == everything and found[replaced.checkpoint_id].started_at == 42.0
    kept = read_index(s3)
    assert kept is not None and {c.checkpoint_id for c in kept.copies if c.marker_mtime} == everything - {
        replaced.checkpoint_id
    }, "what it took from the index stays settled in its own"

    s3.write_bytes(INDEX_PATH, b"not an index")
    assert _first_pass(config, counted_s3, 2, monkeypatch)[1] == dict.fromkeys(everything, 1), "damaged"
    # the index that keeper wrote holds what it read at its first listing: nothing settled yet
    assert _first_pass(config, counted_s3, 3, monkeypatch)[1] == dict.fromkeys(everything, 1), "unsettled"
    s3.delete(INDEX_PATH)
    assert _first_pass(config, counted_s3, 4, monkeypatch)[1] == dict.fromkeys(everything, 1), "absent"
