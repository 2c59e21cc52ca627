"""Review of the marker scan's jump over the commit log (:mod:`tierstore.tiers.s3.listing`) on the
real S3 server of the s3server lane (SeaweedFS): its listing is a walk of directories, so the
children ``.tierstore-b`` and ``.tierstore.c`` (valid ids) come *after* ``.tierstore/``'s keys,
not before them as in S3's key order, and its ``StartAfter`` passes over the whole child named by
the jump's ``.tierstore0``. The jump happens only when the log's keys are met on a page with more
to come: a log longer than a page (1,000 keys), as any job past a thousand commits has."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.s3server import SeaweedServer
from tierstore.config import config_from_dict
from tierstore.ids import INTERNAL_DIR
from tierstore.tiers import Tier

IDS = ["-a", ".tierstore-b", ".tierstore.c", ".tierstore0", "ck1"]


def _tier(seaweed: SeaweedServer, bucket: str) -> Tier:
    spec = {"name": "s3", "type": "s3", "url": f"s3://{bucket}/run", "endpoint_url": seaweed.endpoint}
    config = config_from_dict({"tiers": [spec]})
    tier: Tier = config.make_tiers(node=0)[0]
    return tier


def test_a_log_longer_than_a_page_hides_no_committed_id(seaweed: SeaweedServer, seaweed_bucket: str) -> None:
    tier = _tier(seaweed, seaweed_bucket)
    for checkpoint_id in IDS:
        tier.write_bytes(f"{checkpoint_id}/commit.json", b"{}")
    client = seaweed.client()

    def entry(n: int) -> None:  # the log's keys, written behind the tier's back (only their count matters)
        client.put_object(Bucket=seaweed_bucket, Key=f"run/{INTERNAL_DIR}/commits/{n:012d}~x~g1", Body=b"")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(entry, range(1, 1201)))
    assert sorted(tier.find_in_children("commit.json")) == sorted(IDS), "every id, paged through"
    assert sorted(tier.find_in_children("commit.json", besides=INTERNAL_DIR)) == sorted(IDS)
