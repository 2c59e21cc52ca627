"""The S3 write stream fills part buffers in place and reuses them: never before their part is sent."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, cast

import boto3
import pytest

from tests.faults import FaultyS3
from tierstore.tiers.s3.config import S3TierConfig
from tierstore.tiers.s3.tier import S3Tier
from tierstore.tiers.s3.upload import PARTS_PER_DOUBLING, ObjectUpload, S3WriteStream, part_size_for

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
    config = S3TierConfig(
        name="s3",
        type="s3",
        url=f"s3://{bucket}/p",
        part_size=PART,
        endpoint_url=server.endpoint,
        concurrency=2,
        **fields,
    )
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


@pytest.mark.parametrize("base", [5 * 2**20, 8 * 2**20, 64 * 2**20])
def test_parts_grow_so_an_object_of_5_tib_fits_in_10_000_parts(base: int) -> None:
    """Small parts keep a save's pipeline short, but S3 takes at most 10,000 parts per object: the
    part size doubles every 900 parts (never above S3's 5 GiB), so an object up to S3's 5 TiB
    limit still fits whatever the configured size (fixed 8 MiB parts would stop at 78 GiB)."""
    sizes = [part_size_for(base, number) for number in range(1, 10_001)]
    assert sizes[:900] == [base] * 900, "the configured size for the first 900 parts"
    assert all(5 * 2**20 <= size <= 5 * 2**30 for size in sizes)
    assert sum(sizes) >= 5 * 2**40, sum(sizes) / 2**40


def test_reads_have_their_own_range_size_and_streams() -> None:
    """Writes want small parts, many in flight; reads want long ranges (measured on SeaweedFS,
    docs/performance.md): the read ranges are the tier's own fields, not the part size."""
    config = S3TierConfig(name="s3", type="s3", url="s3://bucket/p")
    tier = S3Tier(config, namespace=None)
    assert (tier.capabilities.transfer_chunk, tier.capabilities.transfer_streams) == (8 << 20, 16)
    assert (tier.capabilities.read_chunk, tier.capabilities.read_streams) == (64 << 20, 8)
    tuned = S3Tier(config.model_copy(update={"read_size": 16 << 20, "read_concurrency": 4}), namespace=None)
    assert (tuned.capabilities.read_chunk, tuned.capabilities.read_streams) == (16 << 20, 4)


class _PartSizes:
    """Stands in for the upload behind a stream: records the size of each part handed to it."""

    started = True

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def add_part(self, data: bytes | bytearray) -> Future[dict[str, Any]]:
        self.sizes.append(len(data))
        sent: Future[dict[str, Any]] = Future()
        sent.set_result({})
        return sent

    def finish(self) -> None:
        pass


def test_the_stream_hands_parts_of_the_growing_size() -> None:
    upload = _PartSizes()
    stream = S3WriteStream(cast(ObjectUpload, upload), 16)
    payload = memoryview(bytes(16 * PARTS_PER_DOUBLING + 32 * 3))
    for start in range(0, len(payload), 7):  # chunks that straddle every part boundary
        stream.write(payload[start : start + 7])
    stream.close()
    assert upload.sizes == [16] * PARTS_PER_DOUBLING + [32] * 3
