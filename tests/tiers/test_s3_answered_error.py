"""S3 requests the store did but answered with an error: an upload that failed leaves nothing
visible, a marker that stands is a commit, and a marker whose fate is unknown says so."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.http_faults import Fault, HttpFaultProxy
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config, config_from_dict
from tierstore.errors import TierUnavailableError
from tierstore.tiers.s3.config import S3TierConfig
from tierstore.tiers.s3.tier import S3Tier

pytestmark = pytest.mark.slow  # each case waits out its retries against a failing proxy (~14 s)

PART = 5 * 2**20


def proxy_to(endpoint: str, fault: Fault, only: Callable[[str, str], bool]) -> HttpFaultProxy:
    """A proxy that breaks every request ``only`` picks, by ``fault``."""
    url = urlsplit(endpoint)
    assert url.hostname is not None and url.port is not None
    return HttpFaultProxy(url.hostname, url.port, rate=1.0, faults=(fault,), only=only)


def s3_tier(endpoint: str, bucket: str) -> S3Tier:
    config = S3TierConfig(
        name="s3",
        type="s3",
        url=f"s3://{bucket}/p",
        part_size=PART,
        endpoint_url=endpoint,
        concurrency=2,
        max_attempts=2,
        max_retry_time=5,
    )
    return S3Tier(config, namespace=None)


def keys(endpoint: str, bucket: str) -> list[str]:
    listing = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)
    return [str(o["Key"]) for o in listing.get("Contents", [])]


@pytest.mark.parametrize("size", [100, 2 * PART + 7], ids=["single PUT", "multipart"])
def test_an_upload_done_but_answered_500_every_time_leaves_nothing_visible(
    s3_endpoint: str, s3_bucket: str, size: int
) -> None:
    def finishing(method: str, path: str) -> bool:
        # the single PUT of a small object, or the POST completing a multipart one
        return (method == "PUT" and size < PART) or (method == "POST" and "uploadId=" in path)

    with proxy_to(s3_endpoint, "500", finishing) as proxy:
        tier = s3_tier(proxy.endpoint, s3_bucket)
        with pytest.raises(TierUnavailableError, match="InternalError"), tier.open_write("obj") as stream:
            stream.write(os.urandom(size))
        assert proxy.injected["500"] == 2, "each attempt of the finishing request answered 500"
    assert keys(s3_endpoint, s3_bucket) == [], "the upload failed, so nothing may be visible"


def test_a_failed_record_rewrite_keeps_the_previous_version(s3_endpoint: str, s3_bucket: str) -> None:
    """Records are rewritten in place: a failed rewrite never deletes the version that stands."""
    puts = lambda method, _path: method == "PUT"  # noqa: E731
    with proxy_to(s3_endpoint, "503", puts) as proxy:
        tier = s3_tier(proxy.endpoint, s3_bucket)
        proxy.configure(rate=0.0)
        tier.write_bytes("record", b"first")
        proxy.configure(rate=1.0, faults=("503",), only=puts)
        with pytest.raises(TierUnavailableError):
            tier.write_bytes("record", b"second")
        proxy.configure(rate=0.0)
        assert tier.read_bytes("record") == b"first"


def marker_put(method: str, path: str) -> bool:
    return method == "PUT" and path.split("?", maxsplit=1)[0].endswith("/commit.json")


def s3_config(endpoint: str, bucket: str, create_only: bool) -> Config:
    spec = {
        "name": "s3",
        "type": "s3",
        "url": f"s3://{bucket}/ckpt",
        "endpoint_url": endpoint,
        "max_attempts": 2,
        "max_retry_time": 5,
        "create_only_markers": create_only,
    }
    return config_from_dict({"namespace": "run", "tiers": [spec]})


@pytest.fixture(params=[True, False], ids=["If-None-Match", "exists check"])
def create_only(request: pytest.FixtureRequest) -> bool:
    """Both ways of publishing a marker create-only."""
    return bool(request.param)


def test_a_marker_put_done_but_answered_500_every_time_is_a_commit(
    s3_endpoint: str, s3_bucket: str, create_only: bool
) -> None:
    state = {"w": torch.arange(1000.0)}
    with proxy_to(s3_endpoint, "500", marker_put) as proxy:
        config = s3_config(proxy.endpoint, s3_bucket, create_only)
        dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="step_000001")
        assert proxy.injected["500"] == 2, "each attempt of the marker PUT answered 500"
        proxy.configure(rate=0.0)
        target: dict[str, Any] = {"w": torch.zeros(1000)}
        dcp.load(target, storage_reader=TieredReader(config), checkpoint_id="step_000001")
    assert torch.equal(target["w"], state["w"])


def test_a_marker_put_never_done_says_the_commit_outcome_is_unknown(
    s3_endpoint: str, s3_bucket: str, create_only: bool
) -> None:
    """Every marker PUT answered 503 without reaching the store: the save fails, says the commit's
    outcome is unknown and how to find it out; nothing is committed."""
    with proxy_to(s3_endpoint, "503", marker_put) as proxy:
        config = s3_config(proxy.endpoint, s3_bucket, create_only)
        with pytest.raises(BaseException) as failed:  # DCP's CheckpointException is one
            dcp.save(
                {"w": torch.arange(10.0)}, storage_writer=TieredWriter(config), checkpoint_id="step_000001"
            )
    message = repr(failed.value)
    assert "step_000001: the commit's outcome in tier s3" in message, message
    assert "tierstore verify step_000001" in message, message
    assert not [k for k in keys(s3_endpoint, s3_bucket) if k.endswith("/commit.json")]


def test_a_create_only_publish_answered_500_that_finds_another_marker_is_refused(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """Every If-None-Match PUT is refused by the store (the name is taken), answered as a 500: what
    stands is another writer's marker, so the publish lost a race, not an unknown."""
    s3_tier(s3_endpoint, s3_bucket).publish("m/commit.json", b"theirs", create_only=True)
    with proxy_to(s3_endpoint, "500", marker_put) as proxy:
        tier = s3_tier(proxy.endpoint, s3_bucket)
        with pytest.raises(FileExistsError):
            tier.publish("m/commit.json", b"ours", create_only=True)
        assert proxy.injected["500"] == 2
    assert s3_tier(s3_endpoint, s3_bucket).read_bytes("m/commit.json") == b"theirs"
