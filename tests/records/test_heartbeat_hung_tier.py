"""The process's one refresher of activity records (``records/activity.py``'s heartbeat) against a
tier that stops answering: a refresh into it may wait for its client, but the records held in the
other tiers go on being refreshed (issue 37, item 5), or cleanup would take their generations for
abandoned once their ``ttl`` passed."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlparse

from tests.fault_proxy import FaultProxy
from tierstore.config import config_from_dict
from tierstore.records.activity import activities, hold

GEN = "g00000000001aaaaaaaa"
TTL = 0.8
"""Seconds a record stays live: refreshed every 0.2 s."""


def test_a_hung_tier_does_not_stop_the_refresh_of_the_records_in_the_others(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
) -> None:
    upstream = urlparse(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        away = {"name": "away", "type": "s3", "url": f"s3://{s3_bucket}/ckpt", "endpoint_url": proxy.endpoint}
        away |= {"max_attempts": 1, "read_timeout": "30s"}
        near = {"name": "near", "type": "local", "path": str(tmp_path / "near")}
        s3, local = config_from_dict({"tiers": [near, away]}).make_tiers(node=0)[::-1]
        held = [hold(s3, "read", "step_1", GEN, ttl=TTL), hold(local, "read", "step_1", GEN, ttl=TTL)]
        try:
            proxy.set_mode("hang")  # the next refresh into S3 waits for its 30 s read timeout
            time.sleep(TTL)
            ages = []
            for _ in range(4):  # 1.6 s since the hang: every age stays under a refresh interval and a beat
                time.sleep(TTL / 4)
                (record,) = activities(local)
                ages.append(record.age)
            assert max(ages) < TTL / 2, f"the local record was not refreshed: ages {ages}"
        finally:
            proxy.set_mode("pass")
            for activity in held:
                activity.release()
