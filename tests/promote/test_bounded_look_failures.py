"""A bounded look counts marker reads that *answered* as progress, never those that failed: an S3
endpoint that stops answering after the listing, with a client ``read_timeout`` shorter than
``probe_timeout``, fails every read by timeout; counted as progress, the look was never given up on
(a read timeout per 16 markers: minutes at 10,000 retained) and ended with the tier reachable and
every copy gone from it (found by review)."""

from __future__ import annotations

import time
from urllib.parse import urlparse

from tests.fault_proxy import FaultProxy
from tests.simulated_job import manifest_for
from tierstore._platform.bounded import Prober
from tierstore.config import config_from_dict
from tierstore.errors import TierUnavailableError
from tierstore.ids import marker_path
from tierstore.promote.discovery import MarkerCache
from tierstore.records.catalog import marker_times
from tierstore.signing import MarkerTrust

MARKERS = 160
READ_TIMEOUT = 0.5
PROBE_TIMEOUT = 1.0


def test_reads_that_time_out_are_not_progress_of_a_bounded_look(s3_endpoint: str, s3_bucket: str) -> None:
    def tier(endpoint: str, name: str):  # type: ignore[no-untyped-def]
        spec = {
            "name": name,
            "type": "s3",
            "url": f"s3://{s3_bucket}/run",
            "endpoint_url": endpoint,
            "max_attempts": 1,
            "read_timeout": f"{READ_TIMEOUT}s",
        }
        return config_from_dict({"tiers": [spec]}).make_tiers(node=0)[0]

    direct = tier(s3_endpoint, "review2-direct")
    for index in range(1, MARKERS + 1):
        manifest = manifest_for(index, 2, "")
        direct.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
    mtimes = marker_times(direct)  # listed before the store stopped answering
    upstream = urlparse(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        proxy.set_mode("hang")
        hung = tier(proxy.endpoint, "review2-hung")
        started = time.monotonic()
        outcome: object = None
        try:
            outcome = Prober(PROBE_TIMEOUT).watch(
                hung,
                lambda _p: MarkerCache(MarkerTrust()).read_all(hung, mtimes),
                what="list its checkpoints",
            )
        except TierUnavailableError:
            outcome = "given up"
        took = time.monotonic() - started
    assert outcome == "given up", f"a store that answered nothing was not given up on: {type(outcome)}"
    assert took < PROBE_TIMEOUT + 1.5, f"the look went on for {took:.1f} s on a store that answered nothing"
