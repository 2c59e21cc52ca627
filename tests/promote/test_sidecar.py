"""The promoter: cascade with every, marker last, crash safety, races, SIGTERM, gc, metrics, nodes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.conftest import open_uploads
from tests.fault_proxy import FaultProxy
from tests.faults import FaultyS3
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config, config_from_dict
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import copy_problems, read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier, make_tier
from tierstore.tiers.s3.tier import S3Tier


def tier(config: Config, name: str, node: int = 0) -> Tier:
    return make_tier(config.tier(name), namespace=config.namespace, node=node)


def save(config: Config, checkpoint_id: str, numel: int = 1000, node: int = 0, **kw: Any) -> dict[str, Any]:
    state = {"w": torch.randn(numel), "step": int(checkpoint_id.rsplit("_", 1)[-1])}
    dcp.save(state, storage_writer=TieredWriter(config, node=node, **kw), checkpoint_id=checkpoint_id)
    return state


def committed(config: Config, name: str, node: int = 0) -> list[str]:
    t = tier(config, name, node)
    return sorted(i for i in t.list_dir("") if t.exists(marker_path(i)))


def assert_complete(config: Config, name: str, checkpoint_id: str) -> None:
    t = tier(config, name)
    manifest = read_manifest(t, checkpoint_id, trust=MarkerTrust())
    assert copy_problems(t, manifest, verify=True) == []


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_cascade_with_every_and_retention(make_config: Callable[..., Config]) -> None:
    config = make_config(
        "memory", "local", "s3", promote={"every": 2}, tiers={"memory": {"keep": 1}, "local": {"keep": 3}}
    )
    for step in range(1, 6):
        save(config, f"step_{step:04d}")
    report = Promoter(config).run_once()
    assert committed(config, "s3") == ["step_0002", "step_0004"]
    assert committed(config, "local") == ["step_0003", "step_0004", "step_0005"]
    assert committed(config, "memory") == ["step_0005"]  # 1-4 promoted where wanted, then deleted
    for checkpoint_id in committed(config, "s3"):
        assert_complete(config, "s3", checkpoint_id)
    marker = read_manifest(tier(config, "s3"), "step_0004", trust=MarkerTrust())
    assert marker.provenance and marker.provenance["tier"] == "local"
    assert marker.timings["durable_lag_s"] is not None and marker.timings["durable_lag_s"] > 0
    assert {d.tier for d in report.deleted} == {"memory"}
    again = Promoter(config).run_once()  # a re-run after success changes nothing
    assert again.promoted == [] and again.deleted == [] and again.failed == []
    assert read_manifest(tier(config, "s3"), "step_0004", trust=MarkerTrust()) == marker


def test_promoted_copy_restores_bit_exact(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "s3")
    state = save(config, "step_0001", numel=200_000)
    Promoter(config).run_once()
    tier(config, "memory").delete(marker_path("step_0001"))
    loaded = {"w": torch.zeros(200_000), "step": 0}
    reader = TieredReader(config)
    dcp.load(loaded, storage_reader=reader, checkpoint_id="step_0001")
    assert reader.chosen_tier == "s3"
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 1


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_interrupted_before_marker_is_completed_on_restart(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("memory", "s3")
    save(config, "step_0001", numel=3_000_000)  # 12 MB: a multipart upload

    def crash(*_args: Any, **_kwargs: Any) -> bool:
        raise OSError("promoter killed between data and marker")

    monkeypatch.setattr("tierstore.promote.job.publish_committed", crash)
    report = Promoter(config).run_once()
    assert report.failed and "killed between data and marker" in report.failed[0][1]
    s3 = tier(config, "s3")
    assert any(f.path.endswith(".distcp") for f in s3.find("step_0001")), "the data is there"
    assert not s3.exists(marker_path("step_0001")), "but no marker"
    s3_only = config_from_dict({"tiers": [config.tier("s3").model_dump()]}, check_paths=False)
    assert latest_committed(s3_only) is None
    monkeypatch.undo()
    assert Promoter(config).run_once().promoted
    assert_complete(config, "s3", "step_0001")


def test_source_failing_verification_is_not_promoted(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local")
    save(config, "step_0001")
    source = tier(config, "memory")
    entry = next(f for f in read_manifest(source, "step_0001", trust=MarkerTrust()).files if f.rank == 0)
    path = Path(source.local_path(f"step_0001/{entry.path}"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    report = Promoter(config).run_once()
    assert len(report.failed) == 1
    message = report.failed[0][1]
    assert "tier memory" in message and entry.path in message and "not promoted" in message
    assert committed(config, "local") == []
    assert tier(config, "local").find("step_0001") == [], "the bad file never became visible"


@pytest.fixture
def faulty_s3() -> Iterator[FaultyS3]:
    server = FaultyS3()
    server.start()
    import boto3

    # moto keeps its buckets per process, not per server: a fresh name per test
    server.bucket = f"faulty-{os.urandom(6).hex()}"
    boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=server.bucket)
    try:
        yield server
    finally:
        server.stop()


def faulty_config(tmp_path: Path, server: FaultyS3, **s3: Any) -> Path:
    spec = {
        "name": "s3",
        "type": "s3",
        "url": f"s3://{server.bucket}/ckpt",
        "endpoint_url": server.endpoint,
        "part_size": "5MiB",
        "concurrency": 2,
        "max_attempts": 4,
        **s3,
    }
    body = {
        "tiers": [{"name": "ram", "type": "memory", "path": str(tmp_path / "ram")}, spec],
        "promote": {"grace_period": 1, "interval": "200ms", "stale_after": 0, "activity_ttl": 1},
    }
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_throttling_and_5xx_are_retried(tmp_path: Path, faulty_s3: FaultyS3) -> None:
    config = config_from_dict(yaml.safe_load(faulty_config(tmp_path, faulty_s3).read_text()))
    save(config, "step_0001", numel=3_000_000)
    faulty_s3.faults.fail(2, status=503, method="PUT", path="partNumber")
    faulty_s3.faults.fail(1, status=500, method="POST", path="uploads")
    promoter = Promoter(config)
    report = promoter.run_once()
    assert report.promoted and not report.failed
    assert promoter.metrics.retries.labels("s3")._value.get() == 3
    assert_complete(config, "s3", "step_0001")


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_exhausted_retries_fail_and_abort_the_upload(tmp_path: Path, faulty_s3: FaultyS3) -> None:
    config = config_from_dict(yaml.safe_load(faulty_config(tmp_path, faulty_s3).read_text()))
    save(config, "step_0001", numel=3_000_000)
    faulty_s3.faults.fail(100, status=503, method="PUT", path="partNumber=2")
    report = Promoter(config).run_once()
    assert report.failed and "tier s3" in report.failed[0][1] and "SlowDown" in report.failed[0][1]
    s3 = tier(config, "s3")
    assert isinstance(s3, S3Tier)
    assert open_uploads(s3) == [], "the multipart upload was aborted"
    assert not s3.exists(marker_path("step_0001"))


def test_access_denied_is_not_retried(tmp_path: Path, faulty_s3: FaultyS3) -> None:
    config = config_from_dict(yaml.safe_load(faulty_config(tmp_path, faulty_s3).read_text()))
    save(config, "step_0001")
    faulty_s3.faults.fail(1, status=403, method="PUT", path="step_0001")  # the promotion's
    promoter = Promoter(config)
    report = promoter.run_once()
    assert report.failed and "AccessDenied" in report.failed[0][1]
    assert promoter.metrics.retries.labels("s3")._value.get() == 0


def cli(config: Path, *args: str, node: int | None = None) -> list[str]:
    node_args = ["--node", str(node)] if node is not None else []
    return [sys.executable, "-m", "tierstore.cli", "--config", str(config), *node_args, *args]


def wait_for_parts(server: FaultyS3, count: int, timeout: float = 60) -> None:
    """Block until the server has seen ``count`` more part uploads (the promoter is mid-upload)."""

    def parts() -> int:
        return sum("partNumber" in path for _method, path in list(server.faults.seen))

    target = parts() + count
    deadline = time.monotonic() + timeout
    while parts() < target:
        assert time.monotonic() < deadline, "the promoter never started uploading"
        time.sleep(0.02)


def test_kill_9_mid_upload_then_restart(tmp_path: Path, faulty_s3: FaultyS3) -> None:
    path = faulty_config(tmp_path, faulty_s3)
    config = config_from_dict(yaml.safe_load(path.read_text()))
    save(config, "step_0001", numel=10_000_000)  # 40 MB: 8 parts of 5 MiB
    s3 = tier(config, "s3")
    for parts in (1, 3, 7):  # several points: first part, mid-way, last part in flight
        faulty_s3.faults.slow(100, 0.2, method="PUT", path="partNumber")
        process = subprocess.Popen(cli(path, "promote"), stderr=subprocess.DEVNULL)
        wait_for_parts(faulty_s3, parts)
        process.send_signal(signal.SIGKILL)
        process.wait()
        faulty_s3.faults.rules.clear()
        if s3.exists(marker_path("step_0001")):  # never a marker over incomplete data
            assert_complete(config, "s3", "step_0001")
    done = subprocess.run(cli(path, "promote", "--once"), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert_complete(config, "s3", "step_0001")
    # The killed promoters' uploads belong to work announced by activity records: cleanup waits
    # until those are stale and the uploads idle as long, then aborts them. Judged first with
    # activity_ttl 60 s, which the records (last written at the kills) are surely within on a
    # loaded machine; with 1 s, `promote --once` above could take longer than that.
    patient = tmp_path / "patient.yaml"
    settings = yaml.safe_load(path.read_text())
    settings["promote"]["activity_ttl"] = 60
    patient.write_text(yaml.safe_dump(settings))
    leftovers = subprocess.run(cli(patient, "gc", "--dry-run"), check=True, capture_output=True, text=True)
    assert "multipart upload" not in leftovers.stdout, "the killed promoters' records are still fresh"
    time.sleep(2.5)
    subprocess.run(cli(path, "gc"), check=True, capture_output=True)  # stale_after: 0
    assert isinstance(s3, S3Tier) and open_uploads(s3) == []


def test_sigterm_finishes_or_abandons_within_the_grace_period(tmp_path: Path, faulty_s3: FaultyS3) -> None:
    path = faulty_config(tmp_path, faulty_s3)
    config = config_from_dict(yaml.safe_load(path.read_text()))
    save(config, "step_0001", numel=10_000_000)
    faulty_s3.faults.slow(100, 1.0, method="PUT", path="partNumber")
    process = subprocess.Popen(cli(path, "promote"), stderr=subprocess.PIPE, text=True)
    wait_for_parts(faulty_s3, 1)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert time.monotonic() - started < 1 + 8, "grace period (1 s) plus the parts in flight"
    s3, ram = tier(config, "s3"), tier(config, "ram")
    assert not s3.exists(marker_path("step_0001")), "abandoned: no marker"
    big = max(read_manifest(ram, "step_0001", trust=MarkerTrust()).files, key=lambda f: f.size)
    assert not s3.exists(f"step_0001/{big.path}"), "the file in flight was abandoned, not published"
    for info in s3.find("step_0001"):  # whatever did become visible is complete
        assert s3.read_bytes(info.path) == ram.read_bytes(info.path)
    assert isinstance(s3, S3Tier) and open_uploads(s3) == [], "its multipart upload was aborted"


def test_two_promoters_racing_commit_once(make_config: Callable[..., Config], tmp_path: Path) -> None:
    config = make_config("memory", "s3")
    path = tmp_path / "race.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    save(config, "step_0001", numel=2_000_000)
    racers = [
        subprocess.Popen(cli(path, "-v", "promote", "--once"), stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    logs = [r.communicate(timeout=120)[1] for r in racers]
    assert [r.returncode for r in racers] == [0, 0], logs
    assert sum("promoted checkpoint=step_0001" in log for log in logs) >= 1
    assert_complete(config, "s3", "step_0001")
    source, target = tier(config, "memory"), tier(config, "s3")
    for entry in read_manifest(source, "step_0001", trust=MarkerTrust()).files:
        assert target.read_bytes(f"step_0001/{entry.path}") == source.read_bytes(f"step_0001/{entry.path}")


def test_gc_dry_run_then_gc(make_config: Callable[..., Config], capsys: pytest.CaptureFixture[str]) -> None:
    from tierstore.cli.main import cmd_gc

    config = make_config("local", tiers={"local": {"keep": 1}}, promote={"stale_after": 60})
    save(config, "step_0001")
    save(config, "step_0002")
    local = tier(config, "local")
    local.write_bytes("step_0003/g00000000001/r00000-0.distcp", b"abandoned save")
    leftover = Path(local.local_path("step_0003/g00000000001/r00000-0.distcp"))
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    temp = Path(local.local_path("step_0002")) / ".x.tmp-123"
    temp.write_bytes(b"half")
    os.utime(temp, (time.time() - 3600, time.time() - 3600))

    class Args:
        node = None
        dry_run = True

    assert cmd_gc(config, Args()) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "would delete step_0001 from local: beyond keep: 1" in out
    assert "would remove step_0003/g00000000001 from local: no commit marker" in out
    assert "would remove step_0002/.x.tmp-123 from local: temporary file" in out
    assert committed(config, "local") == ["step_0001", "step_0002"] and leftover.exists() and temp.exists()
    Args.dry_run = False
    assert cmd_gc(config, Args()) == 0  # type: ignore[arg-type]
    assert committed(config, "local") == ["step_0002"]
    assert not leftover.exists() and not temp.exists()


def test_gc_dry_run_lists_young_leftovers_and_says_when_there_are_none(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]
) -> None:
    """A leftover not yet left alone for stale_after is named as one a later gc removes; with
    none at all, the dry run says so instead of nothing."""
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"tiers": tier_specs("local"), "promote": {"stale_after": "1h"}}))
    config = config_from_dict(yaml.safe_load(path.read_text()))
    save(config, "step_0001")

    def dry_run() -> str:
        done = subprocess.run(cli(path, "gc", "--dry-run"), capture_output=True, text=True, check=True)
        return done.stdout

    assert "cleanup: nothing to remove" in dry_run()
    tier(config, "local").write_bytes("step_0002/g00000000001/r00000-0.distcp", b"a save that failed")
    out = dry_run()
    later = r"would remove later step_0002/g00000000001 from local: no commit marker; untouched for \d+s"
    assert re.search(later + r" \(once left alone for promote.stale_after, 1h00m\)", out), out
    assert "cleanup: nothing to remove" not in out
    assert tier(config, "local").exists("step_0002/g00000000001/r00000-0.distcp"), "a dry run"


def test_retention_deletes_marker_before_data(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("local", tiers={"local": {"keep": 1}})
    save(config, "step_0001")
    save(config, "step_0002")
    local = tier(config, "local")
    events: list[str] = []
    from tierstore.tiers.posix import PosixTier

    real_delete, real_tree = PosixTier.delete, PosixTier.delete_tree
    monkeypatch.setattr(
        PosixTier, "delete", lambda s, p: (events.append(f"delete {p}"), real_delete(s, p))[1]
    )
    monkeypatch.setattr(
        PosixTier, "delete_tree", lambda s, p: (events.append(f"tree {p}"), real_tree(s, p))[1]
    )
    generation = read_manifest(local, "step_0001", trust=MarkerTrust()).generation
    Promoter(config).run_once()
    # The checkpoint's own records and data (the drop's activity record is released after them).
    mine = [e for e in events if "step_0001" in e and ".tierstore/activity/" not in e]
    assert mine[0] == "delete step_0001/commit.json", "the marker goes first"
    entry = mine.index(f"delete .tierstore/commits/000000000001~step_0001~{generation}")
    parts = mine.index(f"tree step_0001/{generation}/parts")
    assert entry < parts < len(mine) - 1, "then its log entry, then its part records"
    assert mine[-1] == f"tree step_0001/{generation}", "the data of the generation it named last"
    assert not local.exists(marker_path("step_0001")) and local.list_dir("step_0001") == []


def test_a_read_lease_protects_from_retention(make_config: Callable[..., Config]) -> None:
    from tierstore.records.activity import held

    config = make_config("local", tiers={"local": {"keep": 1}})
    save(config, "step_0001")
    save(config, "step_0002")
    with held(tier(config, "local"), "read", "step_0001", None):
        assert Promoter(config).run_once().deleted == []
    assert [d.checkpoint_id for d in Promoter(config).run_once().deleted] == ["step_0001"]


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_metrics_endpoint(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "s3")
    save(config, "step_0001")
    promoter = Promoter(config)
    port = promoter.metrics.serve(0, "127.0.0.1")
    promoter.run_once()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'tierstore_promoted_checkpoints_total{tier="s3"} 1.0' in text
    assert 'tierstore_promoted_bytes_total{tier="s3"}' in text
    assert "tierstore_promotion_duration_seconds_bucket" in text
    assert 'tierstore_promotion_backlog{tier="s3"} 0.0' in text
    assert "tierstore_newest_durable_age_seconds" in text
    assert "tierstore_retries_total" in text and "tierstore_promotion_failures_total" in text


def test_gc_leaves_a_checkpoint_whose_marker_it_cannot_read(make_config: Callable[..., Config]) -> None:
    config = make_config("local", promote={"stale_after": 0})
    save(config, "step_0001")
    local = tier(config, "local")
    local.publish(marker_path("step_0001"), b"{half a marker", create_only=False)  # unreadable
    data = [f.path for f in local.find("step_0001") if f.path.endswith(".distcp")]
    Promoter(config).run_once()
    assert all(local.exists(path) for path in data), "no marker read is no licence to delete"


def test_an_unreachable_tier_is_reported_and_the_others_go_on(tmp_path: Path) -> None:
    body = {
        "tiers": [
            {"name": "ram", "type": "memory", "path": str(tmp_path / "ram")},
            {
                "name": "s3",
                "type": "s3",
                "url": "s3://nowhere/x",
                "endpoint_url": "http://127.0.0.1:9",
                "max_attempts": 1,
            },
        ]
    }
    config = config_from_dict(body)
    promoter = Promoter(config)
    promoter.run_once()  # the pass finishes: the memory tier is looked after
    assert "cannot list tier s3 (s3, s3://nowhere/x)" in promoter.unreachable["s3"]
    away = promoter.metrics.registry.get_sample_value("tierstore_tier_unavailable", {"tier": "s3"})
    assert away == 1
    assert promoter.run(once=True) == 1, "a drain that could not reach a tier says so"


def test_a_sigterm_during_the_first_look_stops_the_promoter_cleanly(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    """S3 accepts and never answers, so the promoter's first look waits its probe_timeout; a
    SIGTERM then (Kubernetes deleting the pod at start-up) ends it with 0, not by the signal's
    default action (-15: the handlers were installed only after the look)."""
    upstream = urlparse(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        proxy.set_mode("hang")
        tiers = [
            {"name": "ram", "type": "memory", "path": str(tmp_path / "ram")},
            {"name": "s3", "type": "s3", "url": f"s3://{s3_bucket}/run", "endpoint_url": proxy.endpoint},
        ]
        path = tmp_path / "tierstore.yaml"
        path.write_text(yaml.safe_dump({"tiers": tiers, "probe_timeout": "5s"}))
        argv = [sys.executable, "-m", "tierstore.cli", "--config", str(path), "promote"]
        promoter = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while sum(proxy.accepted.values()) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first look asks S3
        promoter.send_signal(signal.SIGTERM)
        assert promoter.wait(timeout=60) == 0
