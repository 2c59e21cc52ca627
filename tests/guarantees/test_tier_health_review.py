"""The health view's breaker must not cost an operation that the tier could answer: faults found by
review of the per-process tier-health view (``tierstore/_platform/health.py``).

Real components only: moto's S3 server behind the loopback fault proxy (``tests/fault_proxy.py``),
and local files for tiers whose question itself raises.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import boto3
import torch
import torch.distributed.checkpoint as dcp

from tests.fault_proxy import FaultProxy
from tests.guarantees.test_tier_health import PROBE_TIMEOUT, write_config
from tests.request_counter import CountingS3
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter, latest_committed, load_config
from tierstore._platform import health
from tierstore._platform.bounded import Prober
from tierstore.config import Config
from tierstore.errors import TierUnavailableError


def test_a_restore_once_s3_is_back_reads_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """S3 refused a question (its breaker opens), then came back. A restore long after, of an id
    only S3 holds, is served by S3: the old code read it; with the view its first question started
    the probe and was itself answered "skipped", so the restore failed ("no tier holds a usable
    committed copy") although S3 answered."""
    upstream = urlparse(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        config = load_config(write_config(tmp_path, proxy.endpoint, s3_bucket))
        dcp.save({"w": torch.ones(8)}, storage_writer=TieredWriter(config, tier="s3"), checkpoint_id="x")
        proxy.set_mode("refuse")
        latest_committed(config)  # S3 refused: the view holds it unreachable
        s3 = config.make_tier("s3", node=0)
        assert health.view().is_open(s3)
        proxy.set_mode("pass")
        time.sleep(max(PROBE_TIMEOUT, health.RETRY_AFTER) + 0.1)  # a probe is due (a period since it opened)
        target = {"w": torch.zeros(8)}
        reader = TieredReader(config)
        dcp.load(target, storage_reader=reader, checkpoint_id="x")
    assert reader.chosen_tier == "s3" and torch.equal(target["w"], torch.ones(8))
    assert not health.view().is_open(s3)


def test_a_question_that_raises_timeout_error_itself_is_not_a_missed_deadline(tmp_path: Path) -> None:
    """``Prober.ask`` raises a question's own errors as they are, and only an outage opens the
    breaker. A read that fails at once with ``TimeoutError`` (``ETIMEDOUT`` from a soft NFS mount,
    a socket timeout) was taken for the prober's own deadline: reported as "no answer within 2s",
    and the tier skipped by every later question of the process."""
    config = load_config(write_config(tmp_path, "http://127.0.0.1:9", f"ask-{uuid.uuid4().hex[:12]}"))
    tier = config.make_tier("s3", node=0)
    prober = Prober(PROBE_TIMEOUT)

    def question() -> None:
        raise TimeoutError(110, "Connection timed out")

    began = time.monotonic()
    try:
        prober.ask(tier, question, what="read a file")
    except TimeoutError as exc:
        raised: BaseException = exc
    assert type(raised) is TimeoutError and raised.args == (110, "Connection timed out"), raised
    assert time.monotonic() - began < PROBE_TIMEOUT / 2
    assert not health.view().is_open(tier)
    assert prober.ask(tier, lambda: 42) == 42


def test_watch_raises_a_works_own_timeout_error_as_it_is(tmp_path: Path) -> None:
    """Likewise ``Prober.watch`` (verify's reads): a work that raises ``TimeoutError`` itself."""
    config = load_config(write_config(tmp_path, "http://127.0.0.1:9", f"watch-{uuid.uuid4().hex[:12]}"))
    tier = config.make_tier("s3", node=0)

    def work(progress: object) -> None:
        raise TimeoutError(110, "Connection timed out")

    try:
        Prober(PROBE_TIMEOUT).watch(tier, work, what="verify x")
    except TimeoutError as exc:
        raised: BaseException = exc
    assert type(raised) is TimeoutError and raised.args == (110, "Connection timed out"), raised
    assert not health.view().is_open(tier)


def load_with_s3_held_unreachable_on_rank_1(rank: int, world: int, config: Config) -> None:
    """Both ranks restore ``x``; rank 1's own view holds S3 unreachable (its earlier question was
    refused, a moment ago: no probe due yet), rank 0's does not. Rank 1 keeps its verdicts apart
    (as a rank of another node would): on one node rank 0 would read it and skip S3 too."""
    if rank == 1:
        os.environ["TIERSTORE_HEALTH_DIR"] += "-rank1"
        s3 = config.make_tier("s3", node=0)
        refused = TierUnavailableError("tier s3: connection refused", tier="s3", outage=True)
        health.view().failed(s3, refused)
    target = {"w": torch.zeros(8)}
    reader = TieredReader(config)
    dcp.load(target, storage_reader=reader, checkpoint_id="x")
    assert reader.chosen_tier == "s3" and torch.equal(target["w"], torch.ones(8))


def test_every_rank_reading_a_copy_announces_its_read_there(tmp_path: Path) -> None:
    """Rank 0 chooses S3's copy; rank 1, whose view holds S3 unreachable, reads it too (its data
    reads do not ask the view). Every rank reading a copy holds its own read record there (ranks
    finish at different times: rank 0's record goes with its own read_data), or retention may
    delete the copy under rank 1. Rank 1's announcement was answered "skipped" by its view, and it
    read S3's files without a record: one PUT of a read record for two readers."""
    with CountingS3() as counted:
        bucket = f"ts-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=counted.endpoint).create_bucket(Bucket=bucket)
        config = load_config(write_config(tmp_path, counted.endpoint, bucket))
        dcp.save({"w": torch.ones(8)}, storage_writer=TieredWriter(config, tier="s3"), checkpoint_id="x")
        with counted.counting() as seen:
            run_ranks(load_with_s3_held_unreachable_on_rank_1, 2, tmp_path, config)
    print(dict(seen.by_operation))
    assert seen.by_operation["PUT object"] == 2, seen.by_operation  # a read record per rank
