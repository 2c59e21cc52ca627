"""The S3 write stream fills part buffers in place and reuses them: never before their part is sent."""

from __future__ import annotations

import os
from collections.abc import Iterator

import boto3
import pytest

from tests.faults import FaultyS3
from tierstore.tiers.s3.config import S3TierConfig
from tierstore.tiers.s3.tier import S3Tier

PART = 5 * 2**20


@pytest.fixture
def slow_store() -> Iterator[FaultyS3]:
    server = FaultyS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def tier_on(server: FaultyS3, **fields: object) -> S3Tier:
    """An S3 tier with 5 MiB parts, two in flight, in a new bucket of ``server``."""
    bucket = f"b-{os.urandom(6).hex()}"
    boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=bucket)
    config = S3TierConfig(name="s3", type="s3", url=f"s3://{bucket}/p", part_size=PART,
                          endpoint_url=server.endpoint, concurrency=2, **fields)  # fmt: skip
    return S3Tier(config, namespace=None)


def write_in_chunks(tier: S3Tier, path: str, payload: bytes, chunk: int) -> None:
    view = memoryview(payload)
    with tier.open_write(path) as stream:
        for start in range(0, len(payload), chunk):
            stream.write(view[start : start + chunk])


def test_a_part_retried_late_sends_its_own_bytes_while_later_parts_reuse_buffers(
    slow_store: FaultyS3,
) -> None:
    """Part 1 is refused once and its retry is slow: meanwhile later parts are filled and sent
    through the other slot. Without part checksums the store cannot catch a buffer refilled
    before its part was sent: the object read back must be the bytes written."""
    tier = tier_on(slow_store, checksum="none", max_attempts=4)
    slow_store.faults.fail(1, status=503, method="PUT", path="partNumber=1")
    slow_store.faults.slow(1, 1.0, method="PUT", path="partNumber=1")  # the retry
    payload = os.urandom(7 * PART + 12_345)
    write_in_chunks(tier, "obj", payload, chunk=3 * 2**20 + 1)  # chunks straddle part boundaries
    assert tier.read_bytes("obj") == payload
    parts = [p for m, p in slow_store.faults.seen if m == "PUT" and "partNumber=" in p]
    assert len(parts) == 9, parts  # 8 parts, the first one twice


@pytest.mark.parametrize("size", [0, 100, PART, PART + 1, 2 * PART])
def test_objects_around_the_part_size_read_back_whole(slow_store: FaultyS3, size: int) -> None:
    tier = tier_on(slow_store)
    payload = os.urandom(size)
    write_in_chunks(tier, "obj", payload, chunk=2**20 + 7)
    assert tier.read_bytes("obj") == payload
