"""The real S3 server (SeaweedFS, tests/s3server.py): the calls tierstore relies on, and which
conditional writes it honours (the answers are recorded in tests/s3server.py's docstring)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.s3server import SeaweedServer

PART = 5 << 20  # S3's smallest part size (but for the last part)


def _error_code(error: Any) -> tuple[str, int]:
    response = error.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def _multipart(s3: Any, bucket: str, key: str, **complete: Any) -> Any:
    """Upload two 5 MiB parts and complete the upload with ``complete``'s conditions."""
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number in (1, 2):
        body = bytes([number]) * PART
        etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body)["ETag"]
        parts.append({"ETag": etag, "PartNumber": number})
    try:
        return s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}, **complete
        )
    except Exception:
        s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        raise


def test_objects_and_multipart(seaweed: SeaweedServer, seaweed_bucket: str) -> None:
    s3 = seaweed.client(connect_timeout=2, read_timeout=30)
    assert seaweed.endpoint == f"http://127.0.0.1:{seaweed.ports['s3']}"
    s3.put_object(Bucket=seaweed_bucket, Key="a/b", Body=b"hello")
    assert s3.get_object(Bucket=seaweed_bucket, Key="a/b")["Body"].read() == b"hello"
    _multipart(s3, seaweed_bucket, "big")
    body = s3.get_object(Bucket=seaweed_bucket, Key="big")["Body"].read()
    assert body == b"\x01" * PART + b"\x02" * PART
    listed = s3.list_objects_v2(Bucket=seaweed_bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == ["a/b", "big"]


def test_conditional_writes(seaweed: SeaweedServer, seaweed_bucket: str) -> None:
    from botocore.exceptions import ClientError

    s3 = seaweed.client(connect_timeout=2, read_timeout=30, retries={"total_max_attempts": 1})
    bucket = seaweed_bucket
    # Create-only PUT: the second one is refused and the first body stays.
    s3.put_object(Bucket=bucket, Key="once", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        s3.put_object(Bucket=bucket, Key="once", Body=b"second", IfNoneMatch="*")
    assert _error_code(caught.value) == ("PreconditionFailed", 412)
    assert s3.get_object(Bucket=bucket, Key="once")["Body"].read() == b"first"
    # Compare-and-swap PUT: a stale ETag is refused, the current one accepted.
    etag = s3.head_object(Bucket=bucket, Key="once")["ETag"]
    with pytest.raises(ClientError) as caught:
        s3.put_object(Bucket=bucket, Key="once", Body=b"x", IfMatch='"0123456789abcdef"')
    assert _error_code(caught.value) == ("PreconditionFailed", 412)
    s3.put_object(Bucket=bucket, Key="once", Body=b"third", IfMatch=etag)
    # Create-only multipart completion: honoured as well.
    _multipart(s3, bucket, "mpu", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        _multipart(s3, bucket, "mpu", IfNoneMatch="*")
    assert _error_code(caught.value) == ("PreconditionFailed", 412)
    # ... and so is If-Match on completion.
    with pytest.raises(ClientError) as caught:
        _multipart(s3, bucket, "mpu", IfMatch='"0123456789abcdef"')
    assert _error_code(caught.value) == ("PreconditionFailed", 412)
    etag = s3.head_object(Bucket=bucket, Key="mpu")["ETag"]
    _multipart(s3, bucket, "mpu", IfMatch=etag)


def _md5(body: bytes) -> str:
    import base64
    import hashlib

    return base64.b64encode(hashlib.md5(body).digest()).decode()  # noqa: S324 - S3's digest


def test_checksums(seaweed: SeaweedServer, seaweed_bucket: str) -> None:
    """A body is checked against ``x-amz-checksum-crc32`` and ``Content-MD5`` (400 BadDigest on a
    mismatch, in a PUT and in a part); a whole-object GET with ``ChecksumMode=ENABLED`` gets the
    CRC32 back (composite, ``-N``, for a multipart object), a ranged GET none."""
    from botocore.exceptions import ClientError

    from tierstore.tiers.s3.upload import checksum_args

    s3 = seaweed.client(
        retries={"total_max_attempts": 1},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    bucket, body = seaweed_bucket, b"checked " * 1000
    for wrong in (checksum_args(b"other"), {"ContentMD5": _md5(b"other")}):
        with pytest.raises(ClientError) as caught:
            s3.put_object(Bucket=bucket, Key="sum", Body=body, **wrong)
        assert _error_code(caught.value) == ("BadDigest", 400)
    s3.put_object(Bucket=bucket, Key="sum", Body=body, ContentMD5=_md5(body), **checksum_args(body))
    whole = s3.get_object(Bucket=bucket, Key="sum", ChecksumMode="ENABLED")
    assert whole["ChecksumCRC32"] == checksum_args(body)["ChecksumCRC32"]
    ranged = s3.get_object(Bucket=bucket, Key="sum", ChecksumMode="ENABLED", Range="bytes=0-9")
    assert "ChecksumCRC32" not in ranged
    upload = s3.create_multipart_upload(Bucket=bucket, Key="mp", ChecksumAlgorithm="CRC32")
    part = b"p" * PART
    with pytest.raises(ClientError) as caught:
        s3.upload_part(
            Bucket=bucket,
            Key="mp",
            UploadId=upload["UploadId"],
            PartNumber=1,
            Body=part,
            **checksum_args(b"other"),
        )
    assert _error_code(caught.value) == ("BadDigest", 400)
    etag = s3.upload_part(
        Bucket=bucket, Key="mp", UploadId=upload["UploadId"], PartNumber=1, Body=part, **checksum_args(part)
    )["ETag"]
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key="mp",
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag, **checksum_args(part)}]},
    )
    composite = s3.get_object(Bucket=bucket, Key="mp", ChecksumMode="ENABLED")["ChecksumCRC32"]
    assert composite.endswith("-1"), composite


def test_listing_starts_after_a_key_across_pages(seaweed: SeaweedServer, seaweed_bucket: str) -> None:
    """``StartAfter`` (the commit log listed from a known number on, records/log.py), also past a
    page boundary and with a continuation token."""
    s3 = seaweed.client(connect_timeout=2, read_timeout=30)
    keys = [f"ns/log/{n:012d}~x~g{n}" for n in range(1, 8)] + ["ns/logs/000000000009~x"]
    for key in keys:
        s3.put_object(Bucket=seaweed_bucket, Key=key, Body=b"")
    seen, token = [], None
    while True:
        extra = {"ContinuationToken": token} if token else {}
        page = s3.list_objects_v2(
            Bucket=seaweed_bucket, Prefix="ns/log/", MaxKeys=2, StartAfter="ns/log/000000000004", **extra
        )
        seen += [o["Key"] for o in page.get("Contents", [])]
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            break
    assert seen == keys[3:7]
