"""What the keeper's index of a job-wide tier saves (records/index.py), counted at the S3 server:

* a node that does not keep S3 and whose retention deletes in its own node-local tier decides on
  the index made under the stamp it reads, not on a listing of S3 (promote/view.py, ``full``);
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.request_counter import CountingS3, FileOps
from tests.simulated_job import layout, manifest_for
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.records.changes import touch
from tierstore.tiers import Tier
from tierstore.topology import HOST_VARIABLE

NAMESPACE = "job"
LEASE = 3.0
"""Seconds of the keeper's lease: its thread renews it each second, a watcher reads it every two."""


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


@pytest.mark.slow  # ~18 s: two leases waited out
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
    stop = keeper.context.keepers.start()  # renews the lease each second, naming the stamp it read
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
