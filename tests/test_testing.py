"""The embedded S3 endpoint the benchmark runs in a process of its own."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import boto3
import pytest

from tierstore.testing import embedded_s3


@pytest.mark.procs  # embedded_s3(own_process=True) starts the server in a child process
def test_an_s3_server_in_its_own_process_serves_and_stops_with_the_context() -> None:
    with embedded_s3(own_process=True) as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="own-process")
        client.put_object(Bucket="own-process", Key="k", Body=b"payload")
        assert client.get_object(Bucket="own-process", Key="k")["Body"].read() == b"payload"
    where = urlparse(endpoint)
    assert where.hostname == "127.0.0.1" and where.port
    with socket.socket() as probe:
        assert probe.connect_ex((where.hostname, where.port)) != 0, "the server is gone"
