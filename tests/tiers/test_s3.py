"""S3 specifics behind the Tier seam: error translation, retries, create-only markers, aborts."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.conftest import open_uploads
from tests.faults import FaultyS3
from tierstore.errors import TierMisconfiguredError, TierUnavailableError
from tierstore.tiers import RetryHook
from tierstore.tiers.s3.config import S3TierConfig
from tierstore.tiers.s3.tier import S3Tier


def s3_tier(endpoint: str, bucket: str, on_retry: RetryHook | None = None, **extra: object) -> S3Tier:
    config = S3TierConfig(
        name="s3", type="s3", url=f"s3://{bucket}/p", endpoint_url=endpoint, part_size=5 * 2**20, **extra
    )  # type: ignore[arg-type]
    return S3Tier(config, namespace=None, on_retry=on_retry)


@pytest.fixture
def faulty() -> Iterator[tuple[FaultyS3, S3Tier]]:
    server = FaultyS3()
    server.start()
    bucket = f"b-{os.urandom(6).hex()}"
    boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=bucket)
    try:
        yield server, s3_tier(server.endpoint, bucket, max_attempts=4)
    finally:
        server.stop()


def test_unreachable_endpoint_is_a_clear_error_after_bounded_retries() -> None:
    tier = s3_tier("http://127.0.0.1:9", "bucket", max_attempts=2)
    started = time.monotonic()
    with pytest.raises(
        TierUnavailableError, match=r"tier s3 \(s3, s3://bucket/p\): .*cannot reach http://127.0.0.1:9"
    ):
        tier.read_bytes("x")
    assert time.monotonic() - started < 30


def test_missing_bucket_is_named(s3_endpoint: str) -> None:
    tier = s3_tier(s3_endpoint, "no-such-bucket-here")
    with pytest.raises(TierMisconfiguredError, match="bucket 'no-such-bucket-here' does not exist"):
        tier.write_bytes("x", b"data")


def test_access_denied_is_a_configuration_to_fix_not_an_outage(faulty: tuple[FaultyS3, S3Tier]) -> None:
    """A refusal waiting will not change is a TierMisconfiguredError at once, not retried; an outage
    stays a plain TierUnavailableError."""
    server, tier = faulty
    server.faults.fail(1, status=403, method="HEAD")
    started = time.monotonic()
    with pytest.raises(TierMisconfiguredError, match=r"AccessDenied \(HTTP 403\): the credentials may not"):
        tier.stat("x")
    assert time.monotonic() - started < 5, "not retried"
    server.faults.fail(100, status=503, method="HEAD")
    with pytest.raises(TierUnavailableError) as outage:
        tier.stat("x")
    assert not isinstance(outage.value, TierMisconfiguredError)


def test_transient_errors_are_retried_and_counted(faulty: tuple[FaultyS3, S3Tier]) -> None:
    server, tier = faulty
    retried: list[BaseException] = []
    tier = s3_tier(server.endpoint, tier.bucket, lambda _name, error: retried.append(error), max_attempts=4)
    server.faults.fail(2, status=503, method="PUT")
    tier.write_bytes("a/object", b"payload")
    assert tier.read_bytes("a/object") == b"payload"
    assert len(retried) == 2


def test_an_outage_is_logged_once_not_once_per_attempt(
    faulty: tuple[FaultyS3, S3Tier], caplog: pytest.LogCaptureFixture
) -> None:
    """Hundreds of attempts in a long outage are one WARNING; the rest are DEBUG detail, and the
    request that succeeds again says how many failed."""
    server, tier = faulty
    tier.write_bytes("a/object", b"payload")
    caplog.set_level(logging.DEBUG, logger="tierstore.tiers.s3.retry")
    server.faults.fail(1000, status=503, method="GET")
    for _ in range(3):
        with pytest.raises(TierUnavailableError):
            tier.read_bytes("a/object")
    server.faults.rules.clear()
    assert tier.read_bytes("a/object") == b"payload"
    retries = [r for r in caplog.records if r.getMessage().startswith("retrying ")]
    assert len(retries) == 3 * 3, "every attempt but each request's last is retried"
    assert [r.levelno for r in retries].count(logging.WARNING) == 1, "one warning for the outage"
    ended = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert ended and "succeeded after 9 failed attempts" in ended[-1]


def test_a_ranged_read_cut_short_by_the_server_is_retried(faulty: tuple[FaultyS3, S3Tier]) -> None:
    server, tier = faulty
    payload = os.urandom(3 * 2**20)
    tier.write_bytes("a/object", payload)
    retried: list[BaseException] = []
    tier = s3_tier(server.endpoint, tier.bucket, lambda _name, error: retried.append(error), max_attempts=4)
    server.faults.cut(1, method="GET", path="a/object")
    out = bytearray(2**20 + 7)
    tier.read_into("a/object", 2**20, memoryview(out))
    assert bytes(out) == payload[2**20 : 2**21 + 7]
    assert len(retried) == 1 and "cut short" in str(retried[0])


def test_threads_asking_at_once_share_one_client(s3_endpoint: str, s3_bucket: str) -> None:
    tier = s3_tier(s3_endpoint, s3_bucket)
    together = threading.Barrier(8)

    def first_use(_: int) -> object:
        together.wait()
        return tier.s3.client

    with ThreadPoolExecutor(8) as pool:
        clients = list(pool.map(first_use, range(8)))
    assert len({id(c) for c in clients}) == 1


def test_tiers_have_clients_of_their_own_from_one_parsed_service_model(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """Parsing the S3 service model costs about 0.1 s of CPU: once per process, not per tier."""
    first, second = s3_tier(s3_endpoint, s3_bucket), s3_tier(s3_endpoint, s3_bucket)
    assert first.s3.client is not second.s3.client
    assert first.s3.client._loader is second.s3.client._loader


def test_a_forked_child_gets_clients_and_part_slots_of_its_own(s3_endpoint: str, s3_bucket: str) -> None:
    """A fork while the parent's threads hold the client lock and every part slot (uploads in
    flight) must neither hang the child nor hand it the parent's clients: their keep-alive sockets
    would be shared by two processes, and s3fs refuses to run after a fork."""
    tier = s3_tier(s3_endpoint, s3_bucket, concurrency=2)
    tier.write_bytes("before-fork", b"parent")
    assert tier.list_dir("") == ["before-fork"]  # the parent's s3fs is running too
    parents_client = tier.s3.client
    holding, release = threading.Event(), threading.Event()

    def in_flight() -> None:
        with tier.s3._client_lock:
            for _ in range(tier.s3.concurrency):
                tier.s3.part_slots.acquire()
            holding.set()
            release.wait()
        for _ in range(tier.s3.concurrency):
            tier.s3.part_slots.release()

    holder = threading.Thread(target=in_flight)
    holder.start()
    holding.wait()
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and never return into pytest
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
            signal.alarm(30)  # a hang kills the child: the parent sees the signal
            own = tier.s3.client is not parents_client
            seen = tier.read_range("before-fork")
            with tier.open_write("from-child") as stream:  # two parts: both slots are needed
                stream.write(b"c" * (6 * 2**20))
            listed = tier.list_dir("")
            os.write(writable, json.dumps([own, seen.decode(), listed]).encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
            os.write(writable, json.dumps({"child failed": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(writable)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    with os.fdopen(readable, "rb") as pipe:
        report = pipe.read()
    assert os.WIFEXITED(status), f"the child hung on the parent's lock or part slots ({status})"
    assert json.loads(report) == [True, "parent", ["before-fork", "from-child"]]
    assert tier.read_range("from-child") == b"c" * (6 * 2**20)
    assert tier.s3.client is parents_client, "the parent keeps its own client"


def _signing_key(tier: S3Tier) -> str:
    """The access key the tier's uploads are signed with (one small PUT through its client)."""
    keys: list[str] = []

    def seen(request: Any, **_: Any) -> None:
        keys.append(request.headers["Authorization"].decode().split("Credential=")[1].split("/")[0])

    tier.s3.client.meta.events.register("before-send.s3", seen)
    tier.write_bytes("signed", b"x")
    return keys[-1]


@pytest.mark.parametrize("source", ["environment", "credentials file"])
def test_a_new_tier_signs_with_the_credentials_of_its_time(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """Rotated keys (a refreshed credentials file, new environment) reach every tier made after
    the rotation: a new reader, a PROCESS-mode save's unpickled writer. A shared session would
    keep signing with the first keys it resolved."""
    credentials = tmp_path / "credentials"

    def rotate_to(key: str) -> None:
        if source == "environment":
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", f"secret-{key}")
            return
        monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        credentials.write_text(
            f"[default]\naws_access_key_id = {key}\naws_secret_access_key = secret-{key}\n"
        )

    monkeypatch.delenv("AWS_PROFILE", raising=False)
    rotate_to("AKIAFIRSTKEY")
    assert _signing_key(s3_tier(s3_endpoint, s3_bucket)) == "AKIAFIRSTKEY"
    rotate_to("AKIASECONDKEY")
    assert _signing_key(s3_tier(s3_endpoint, s3_bucket)) == "AKIASECONDKEY"


def test_reading_into_a_missing_object_names_it(s3_endpoint: str, s3_bucket: str) -> None:
    tier = s3_tier(s3_endpoint, s3_bucket)
    with pytest.raises(FileNotFoundError, match=f"s3://{s3_bucket}/p/no/such-object"):
        tier.read_into("no/such-object", 0, memoryview(bytearray(10)))


def test_create_only_publish_refuses_a_taken_name_and_accepts_its_own_retry(
    faulty: tuple[FaultyS3, S3Tier],
) -> None:
    server, tier = faulty
    tier.publish("m/commit.json", b"ours", create_only=True)
    # A retried create-only PUT that finds its own first attempt (same bytes) is a success...
    tier.publish("m/commit.json", b"ours", create_only=True)
    # ...another writer's marker is not.
    with pytest.raises(FileExistsError):
        tier.publish("m/commit.json", b"theirs", create_only=True)
    assert tier.read_bytes("m/commit.json") == b"ours"
    # The store referees with 412 PreconditionFailed; an injected one is handled the same way.
    server.faults.fail(1, status=412, method="PUT", path="n/commit.json")
    with pytest.raises(FileExistsError):
        tier.publish("n/commit.json", b"x", create_only=True)


def test_failed_multipart_upload_is_aborted(faulty: tuple[FaultyS3, S3Tier]) -> None:
    server, tier = faulty
    server.faults.fail(100, status=500, method="PUT", path="partNumber=2")
    with pytest.raises(TierUnavailableError, match="InternalError"):
        tier.write_bytes("big", os.urandom(12 * 2**20))
    assert open_uploads(tier) == []
    assert not tier.exists("big")


@pytest.mark.parametrize("checksum", ["crc32c", "none"])
def test_a_retried_part_sends_its_whole_body_again(faulty: tuple[FaultyS3, S3Tier], checksum: str) -> None:
    """botocore sends a part's bytes as a stream; our retry (botocore's own are off) must not
    resume where the failed attempt stopped reading (without checksums a short part would pass)."""
    server, tier = faulty
    retried: list[BaseException] = []
    tier = s3_tier(
        server.endpoint,
        tier.bucket,
        lambda _name, error: retried.append(error),
        max_attempts=4,
        checksum=checksum,
    )
    server.faults.fail(1, status=503, method="PUT", path="partNumber=1")
    payload = os.urandom(11 * 2**20)
    tier.write_bytes("obj", payload)
    assert tier.read_bytes("obj") == payload
    assert len(retried) == 1


@pytest.mark.parametrize(
    ("checksum", "kept"), [("crc32c", "ChecksumCRC32C"), ("crc32", "ChecksumCRC32"), ("none", None)]
)
def test_multipart_with_and_without_part_checksums(
    s3_endpoint: str, s3_bucket: str, checksum: str, kept: str | None
) -> None:
    tier = s3_tier(s3_endpoint, s3_bucket, checksum=checksum)
    payload = os.urandom(11 * 2**20)
    tier.write_bytes("obj", payload)
    assert tier.read_bytes("obj") == payload
    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
        Bucket=s3_bucket, Key="p/obj", ChecksumMode="ENABLED"
    )
    assert sorted(k for k in head if k.startswith("ChecksumCRC")) == ([kept] if kept else [])


def test_upload_listing_stays_inside_the_namespace(s3_endpoint: str, s3_bucket: str) -> None:
    from tierstore.tiers.s3.config import S3TierConfig

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_multipart_upload(Bucket=s3_bucket, Key="p/job10/step/file")
    config = S3TierConfig(name="s3", type="s3", url=f"s3://{s3_bucket}/p", endpoint_url=s3_endpoint)
    job1, job10 = S3Tier(config, namespace="job1"), S3Tier(config, namespace="job10")
    assert open_uploads(job1) == [], "job1's gc must not see job10's uploads"
    assert open_uploads(job10) == ["step/file"]


def test_asking_for_a_missing_object_is_one_request(faulty: tuple[FaultyS3, S3Tier]) -> None:
    """Every save asks the commit protocol's small questions in sequence: s3fs's ``info`` listed the
    prefix after a 404 (to tell a directory), two requests for each ``exists`` that found nothing."""
    server, tier = faulty
    tier.write_bytes("dir/here.json", b"12345")
    server.faults.seen.clear()
    assert not tier.exists("dir/missing.json")
    assert not tier.exists("nowhere/missing.json")
    info = tier.stat("dir/here.json")
    assert (info.path, info.size) == ("dir/here.json", 5)
    assert info.mtime > 0
    assert [method for method, _path in server.faults.seen] == ["HEAD", "HEAD", "HEAD"]
    with pytest.raises(FileNotFoundError, match=r"dir/missing\.json"):
        tier.stat("dir/missing.json")


@pytest.mark.slow  # over 1,000 objects written to moto first (6 s): make test runs it, make quick does not
def test_listing_pages_past_a_thousand_objects_without_building_s3fs(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """A save or restore through a new tier lists its records before its first byte: through s3fs
    that listing first built an aiobotocore client and event loop (about 65 ms of CPU)."""
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    keys = [f"p/many/{n:05d}" for n in range(1003)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=s3_bucket, Key=key, Body=b"x"), keys))
    client.put_object(Bucket=s3_bucket, Key="p/many/folder/", Body=b"")  # a folder placeholder
    tier = s3_tier(s3_endpoint, s3_bucket)
    found = tier.find("many")
    assert [f.path for f in found] == [key.removeprefix("p/") for key in keys]
    assert {f.size for f in found} == {1} and all(f.mtime > 0 for f in found)
    assert [f.path for f in tier.find("many", after="many/01000")] == ["many/01001", "many/01002"]
    assert tier.s3._fs is None, "the listing went through s3fs"
