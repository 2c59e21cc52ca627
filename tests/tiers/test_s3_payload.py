"""What the S3 tier sends with each body: its CRC32, and a SHA-256 signature only where nothing
else checks it (see :meth:`tierstore.tiers.s3.client.S3Client._payload_signing`)."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlparse

import boto3
import pytest

from tests.faults import FaultyS3
from tests.http_faults import HttpFaultProxy
from tests.s3server import SeaweedServer
from tierstore.checksum import crc32c
from tierstore.tiers.s3.config import S3TierConfig
from tierstore.tiers.s3.tier import S3Tier

UNSIGNED = "UNSIGNED-PAYLOAD"


class Recorded:
    """Every request's method, query and body headers, as the store received them."""

    def __init__(self, server: FaultyS3) -> None:
        self.seen: list[dict[str, str]] = []
        app = server.faults.app

        def recording(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            self.seen.append(
                {
                    "method": environ["REQUEST_METHOD"],
                    "path": environ.get("PATH_INFO", ""),
                    "query": environ.get("QUERY_STRING", ""),
                    "sha256": environ.get("HTTP_X_AMZ_CONTENT_SHA256", ""),
                    "crc32": environ.get("HTTP_X_AMZ_CHECKSUM_CRC32", ""),
                    "crc32c": environ.get("HTTP_X_AMZ_CHECKSUM_CRC32C", ""),
                }
            )
            return app(environ, start_response)

        server.faults.app = recording

    def bodies(self) -> list[dict[str, str]]:
        """The requests that carried an object's bytes (a PUT of a key: an object or a part)."""
        return [r for r in self.seen if r["method"] == "PUT" and r["path"].strip("/").count("/")]


@pytest.fixture
def store() -> Iterator[tuple[FaultyS3, Recorded]]:
    server = FaultyS3()
    recorded = Recorded(server)
    server.start()
    try:
        yield server, recorded
    finally:
        server.stop()


def tier_on(endpoint: str, bucket: str, **fields: object) -> S3Tier:
    config = S3TierConfig(
        name="s3",
        type="s3",
        url=f"s3://{bucket}/p",
        endpoint_url=endpoint,
        part_size=5 * 2**20,
        concurrency=2,
        **fields,
    )  # type: ignore[arg-type]
    return S3Tier(config, namespace=None)


def encoded(crc: int) -> str:
    """A CRC as S3's checksum headers carry it."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def new_bucket(endpoint: str) -> str:
    bucket = f"b-{os.urandom(6).hex()}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return bucket


def test_bodies_with_a_checksum_go_unsigned_on_plain_http(store: tuple[FaultyS3, Recorded]) -> None:
    """botocore hashes every body on plain HTTP for the signature: a third of the client's CPU
    in an upload, for a check the CRC32 sent with the body already gives the store."""
    server, recorded = store
    tier = tier_on(server.endpoint, new_bucket(server.endpoint))
    tier.write_bytes("big", os.urandom(11 * 2**20))  # three parts
    tier.publish("marker.json", b"{}", create_only=True)  # one PUT
    bodies = recorded.bodies()
    assert len(bodies) == 4
    assert all(r["crc32"] or r["crc32c"] for r in bodies), bodies
    assert [r["sha256"] for r in bodies] == [UNSIGNED] * 4


def test_parts_carry_a_crc32c_and_whole_objects_a_crc32(store: tuple[FaultyS3, Recorded]) -> None:
    """zlib's CRC32 took a sixth of the client's CPU in an upload; CRC32C runs 5x faster
    here. A whole object keeps CRC32: botocore checks that one on a whole read without the CRT."""
    server, recorded = store
    tier = tier_on(server.endpoint, new_bucket(server.endpoint))
    payload = os.urandom(11 * 2**20)
    tier.write_bytes("big", payload)  # three parts
    tier.publish("marker.json", b"{}", create_only=True)
    parts = [payload[i : i + 5 * 2**20] for i in range(0, len(payload), 5 * 2**20)]
    sent = {
        r["query"].split("partNumber=")[1].split("&")[0]: (r["crc32c"], r["crc32"])
        for r in recorded.bodies()
        if "partNumber=" in r["query"]
    }
    wanted = {str(n): (encoded(crc32c(p)), "") for n, p in enumerate(parts, 1)}
    assert sent == wanted
    marker = [r for r in recorded.bodies() if r["path"].endswith("marker.json")]
    assert [(r["crc32"], r["crc32c"]) for r in marker] == [(encoded(zlib.crc32(b"{}")), "")]


@pytest.mark.parametrize("fields", [{"checksum": "none"}, {"sign_payload": True}])
def test_bodies_stay_signed_without_a_checksum_or_when_asked(
    store: tuple[FaultyS3, Recorded], fields: dict[str, object]
) -> None:
    server, recorded = store
    tier = tier_on(server.endpoint, new_bucket(server.endpoint), **fields)
    payload = os.urandom(6 * 2**20)
    tier.write_bytes("big", payload)  # two parts
    parts = [payload[: 5 * 2**20], payload[5 * 2**20 :]]
    signed = {r["query"].split("partNumber=")[1].split("&")[0]: r["sha256"] for r in recorded.bodies()}
    assert signed == {str(n): hashlib.sha256(p).hexdigest() for n, p in enumerate(parts, 1)}


@pytest.mark.s3server
def test_an_unsigned_part_damaged_on_the_way_is_refused_and_sent_again(
    seaweed: SeaweedServer, seaweed_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Unsigned, a part's CRC32 is all the store checks it by: SeaweedFS refuses a flipped byte
    (BadDigest), the part is sent again, and the object read back is the bytes written."""
    endpoint = urlparse(seaweed.endpoint)
    assert endpoint.hostname is not None and endpoint.port is not None
    caplog.set_level(logging.DEBUG, logger="tierstore.tiers.s3.retry")
    with HttpFaultProxy(endpoint.hostname, endpoint.port) as proxy:
        tier = tier_on(proxy.endpoint, seaweed_bucket, max_attempts=8)
        payload = os.urandom(16 * 2**20)  # four parts
        proxy.configure(
            rate=0.5,
            faults=["flip_request"],
            seed=3,
            only=lambda method, path: method == "PUT" and "partNumber=" in path,
        )
        tier.write_bytes("flipped", payload)
        proxy.configure(rate=0.0)
        assert proxy.injected["flip_request"] > 0
        assert tier.read_bytes("flipped") == payload
    retried = [r for r in caplog.records if r.getMessage().startswith("retrying ")]
    assert len(retried) >= proxy.injected["flip_request"], "each damaged part was refused"
