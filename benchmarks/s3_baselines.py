"""The S3 clients tierstore is measured against, pointed at one endpoint (see :mod:`benchmarks.s3_real`).

* boto3's transfer manager moving one object of the same bytes: the best of several concurrencies,
  each timed in the same round, so a client that tunes itself to this server is not penalised;
* s3torchconnector's DCP ``S3StorageWriter``/``S3StorageReader`` (AWS CRT client). Their
  constructors take a region, not an endpoint, so each gets an ``S3FileSystem`` built on a client
  that has one (path-style addressing: the bucket is not a DNS name on loopback).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BOTO3_CONCURRENCY = (4, 8, 16)
"""The concurrencies tried for boto3 in every round; the fastest counts."""

REGION = "us-east-1"


def best_boto3(
    client: Any, move: str, source: Path, bucket: str, key: str, *, cpu: dict[int, float] | None = None
) -> dict[int, float]:
    """Seconds of ``move`` ("upload" or "download") of ``bucket/key`` at each concurrency; ``cpu``,
    when given, receives this process's CPU seconds (every thread) of each.

    Uploads read ``source``; downloads write it (deleted first, untimed: a landing in fresh memory,
    as a restore's is). The transfer manager's own part size is kept (8 MiB).
    """
    from boto3.s3.transfer import TransferConfig

    seconds: dict[int, float] = {}
    for concurrency in BOTO3_CONCURRENCY:
        config = TransferConfig(max_concurrency=concurrency)
        if move == "upload":
            started, used = time.perf_counter(), time.process_time()
            client.upload_file(str(source), bucket, key, Config=config)
        else:
            source.unlink(missing_ok=True)
            started, used = time.perf_counter(), time.process_time()
            client.download_file(bucket, key, str(source), Config=config)
        seconds[concurrency] = time.perf_counter() - started
        if cpu is not None:
            cpu[concurrency] = time.process_time() - used
    return seconds


def _connector_fs(endpoint: str, reader_constructor: Any = None) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem

    client = S3Client(REGION, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
    return S3FileSystem(REGION, s3_client=client, reader_constructor=reader_constructor)


def connector_writer(endpoint: str, path: str) -> Any:
    """s3torchconnector's DCP writer for ``path`` (``s3://bucket/prefix``) on ``endpoint``."""
    from s3torchconnector.dcp import S3StorageWriter

    writer = S3StorageWriter(REGION, path)
    writer.fs = _connector_fs(endpoint)
    writer.path = writer.fs.init_path(path)
    return writer


def connector_reader(endpoint: str, path: str) -> Any:
    """s3torchconnector's DCP reader (its default, DCP-optimised ranged reads) on ``endpoint``."""
    from s3torchconnector.dcp import S3StorageReader

    reader = S3StorageReader(REGION, path)
    reader.fs = _connector_fs(endpoint, reader._reader_constructor)
    reader.path = reader.fs.init_path(path)
    return reader


def connector_available() -> bool:
    """Whether s3torchconnector is installed (the ``bench`` extra); without it, boto3 only."""
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError:
        return False
    return True


def rotated(index: int, runs: list[Callable[[], float]]) -> list[float]:
    """Run ``runs`` starting at the one ``index`` rotates to; their results in the given order."""
    shift = index % len(runs)
    results = [0.0] * len(runs)
    for position in [*range(shift, len(runs)), *range(shift)]:
        results[position] = runs[position]()
    return results
