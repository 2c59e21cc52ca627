"""A promoter's parallel marker reads against a store that stops answering mid-pass: the pass ends
within ``probe_timeout`` (Prober) and the process can still exit at once: the reads left hanging
must not hold the interpreter's exit (a stopped promoter, ``tierstore promote --once``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from urllib.parse import urlparse

from tests.fault_proxy import FaultProxy
from tests.simulated_job import manifest_for
from tierstore.config import config_from_dict
from tierstore.ids import marker_path

CHILD = textwrap.dedent(
    """
    import sys, time
    from tierstore._platform.bounded import Prober
    from tierstore.config import config_from_dict
    from tierstore.errors import TierUnavailableError
    from tierstore.promote.discovery import MarkerCache
    from tierstore.records.catalog import marker_times
    from tierstore.signing import MarkerTrust

    bucket, direct, proxied = sys.argv[1:4]
    def tier(endpoint):
        spec = {"name": "s3", "type": "s3", "url": f"s3://{bucket}/run", "endpoint_url": endpoint,
                "max_attempts": 1, "read_timeout": "20s"}
        return config_from_dict({"tiers": [spec]}).make_tiers(node=0)[0]
    mtimes = marker_times(tier(direct))  # listed before the store stopped answering
    hung = tier(proxied)
    started = time.monotonic()
    try:
        Prober(1.0).ask(hung, lambda: MarkerCache(MarkerTrust()).read_all(hung, mtimes))
    except TierUnavailableError:
        print(f"pass ended after {time.monotonic() - started:.1f} s", flush=True)
    """
)


def test_marker_reads_left_hanging_do_not_hold_the_process_exit(s3_endpoint: str, s3_bucket: str) -> None:
    """The markers were listed, then the store stopped answering (proxy: ``hang``): the pass
    gives up after ``probe_timeout`` (1 s) and the process ends at once, not after the client's
    read timeout (20 s) of every read left hanging."""
    spec = {"name": "s3", "type": "s3", "url": f"s3://{s3_bucket}/run", "endpoint_url": s3_endpoint}
    (s3,) = config_from_dict({"tiers": [spec]}).make_tiers(node=0)
    for index in range(1, 9):
        manifest = manifest_for(index, 2, "")
        s3.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
    upstream = urlparse(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        proxy.set_mode("hang")
        started = time.monotonic()
        child = subprocess.run(
            [sys.executable, "-c", CHILD, s3_bucket, s3_endpoint, proxy.endpoint],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    took = time.monotonic() - started
    print(child.stdout, child.stderr[-2000:], f"process exited after {took:.1f} s")
    assert "pass ended after" in child.stdout, child.stderr[-2000:]
    assert took < 12, f"the hung reads held the exit for {took:.1f} s (read timeout: 20 s)"
