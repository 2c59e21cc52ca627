"""The fault proxy (tests/fault_proxy.py), mode by mode, between boto3 and a real moto server."""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fault_proxy import FaultProxy

# Placeholder credentials (moto accepts any); conftest sets the same before any client exists.
_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, int]]:
    """``(host, port)`` of a moto S3 server on loopback, for this module."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield server.get_host_and_port()
    finally:
        server.stop()


@pytest.fixture
def proxy(upstream: tuple[str, int]) -> Iterator[FaultProxy]:
    """A running proxy in front of moto, in ``"pass"`` mode."""
    with FaultProxy(*upstream) as running:
        yield running


def client(endpoint: str, **config: Any) -> Any:
    """A boto3 client that fails fast: one attempt, 1 s to connect, 1 s per read."""
    import boto3
    from botocore.config import Config

    # One attempt in all: in botocore's retry config, "max_attempts" counts retries.
    settings: dict[str, Any] = {
        "connect_timeout": 1,
        "read_timeout": 1,
        "retries": {"total_max_attempts": 1},
        **config,
    }
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(**settings), **_CREDENTIALS
    )


def new_bucket(s3: Any) -> str:
    name = f"ts-{uuid.uuid4().hex[:16]}"
    s3.create_bucket(Bucket=name)
    return name


def upstream_url(upstream: tuple[str, int]) -> str:
    return f"http://{upstream[0]}:{upstream[1]}"


def test_pass_forwards_both_ways(proxy: FaultProxy) -> None:
    s3 = client(proxy.endpoint)
    bucket = new_bucket(s3)
    body = bytes(range(256)) * 12_288  # 3 MiB: many recv/send rounds each way
    s3.put_object(Bucket=bucket, Key="k", Body=body)
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == body
    assert proxy.accepted["pass"] >= 1
    assert proxy.endpoint == f"http://127.0.0.1:{proxy.port}"


def test_refuse_closes_the_port_and_reopens_the_same_one(proxy: FaultProxy) -> None:
    from botocore.exceptions import EndpointConnectionError

    s3 = client(proxy.endpoint)
    bucket = new_bucket(s3)  # leaves a pooled keep-alive connection behind
    port = proxy.port
    proxy.set_mode("refuse")
    with pytest.raises(EndpointConnectionError):
        s3.head_bucket(Bucket=bucket)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    proxy.set_mode("pass")
    assert proxy.port == port
    s3.head_bucket(Bucket=bucket)
    assert proxy.accepted["refuse"] == 0


@pytest.mark.slow  # waits on purpose: make test runs it, make quick does not
def test_hang_times_the_client_out(proxy: FaultProxy) -> None:
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    s3 = client(proxy.endpoint)
    bucket = new_bucket(s3)
    proxy.set_mode("hang")
    started = time.monotonic()
    with pytest.raises((ReadTimeoutError, ConnectTimeoutError)):
        s3.put_object(Bucket=bucket, Key="k", Body=b"never stored")
    assert time.monotonic() - started < 3
    assert proxy.accepted["hang"] == 1
    proxy.set_mode("pass")
    with pytest.raises(s3.exceptions.NoSuchKey):  # the hung PUT never reached moto
        s3.get_object(Bucket=bucket, Key="k")


def test_reset_fails_the_connection(proxy: FaultProxy) -> None:
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    s3 = client(proxy.endpoint)
    bucket = new_bucket(s3)
    proxy.set_mode("reset")
    # Which one depends on whether the RST lands before urllib3 is done connecting.
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        s3.put_object(Bucket=bucket, Key="k", Body=b"never stored")
    assert proxy.accepted["reset"] == 1
    proxy.set_mode("pass")
    with pytest.raises(s3.exceptions.NoSuchKey):
        s3.get_object(Bucket=bucket, Key="k")


def test_503_answers_slow_down_without_reaching_the_upstream(
    proxy: FaultProxy, upstream: tuple[str, int]
) -> None:
    from botocore.exceptions import ClientError

    s3 = client(proxy.endpoint)
    bucket = new_bucket(s3)
    s3.put_object(Bucket=bucket, Key="k", Body=b"stored")
    proxy.set_mode("503")
    for _ in range(3):
        with pytest.raises(ClientError) as caught:
            s3.get_object(Bucket=bucket, Key="k")
        assert caught.value.response["Error"]["Code"] == "SlowDown"
        assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    # Requests of known length are consumed whole: the three answers shared one connection.
    assert proxy.accepted["503"] == 1
    # botocore sends every PUT with "Expect: 100-continue": answered before the body, then closed.
    for key, body in (("small", b"x"), ("big", b"x" * (2 << 20))):
        with pytest.raises(ClientError) as caught:
            s3.put_object(Bucket=bucket, Key=key, Body=body)
        assert caught.value.response["Error"]["Code"] == "SlowDown"
    listing = client(upstream_url(upstream)).list_objects_v2(Bucket=bucket)
    assert [o["Key"] for o in listing["Contents"]] == ["k"]  # no PUT reached moto
    proxy.set_mode("pass")
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"stored"


def test_a_switch_cuts_pooled_connections(proxy: FaultProxy) -> None:
    from botocore.exceptions import ClientError

    s3 = client(proxy.endpoint)
    bucket = new_bucket(s3)
    s3.head_bucket(Bucket=bucket)  # a keep-alive connection now sits in boto3's pool
    passed = proxy.accepted["pass"]
    proxy.set_mode("503")
    with pytest.raises(ClientError) as caught:
        s3.head_bucket(Bucket=bucket)  # HEAD: no body, so botocore names the error by its status
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    proxy.set_mode("pass")
    s3.head_bucket(Bucket=bucket)
    assert proxy.accepted["pass"] == passed + 1  # the pooled connection was not reused
    assert proxy.accepted["503"] == 1


def test_stop_closes_the_port(upstream: tuple[str, int]) -> None:
    with FaultProxy(*upstream) as proxy:
        port = proxy.port
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        proxy.set_mode("hang")
        hung = socket.create_connection(("127.0.0.1", port), timeout=1)
    with hung:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        with contextlib.suppress(ConnectionResetError):  # stop() cut it too: FIN, then RST
            assert hung.recv(1) == b""
