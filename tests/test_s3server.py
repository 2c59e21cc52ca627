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
        etag = s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body
        )["ETag"]
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
