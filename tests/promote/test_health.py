"""Promoter health: heartbeats decide ``/healthz`` and ``/readyz``, served beside ``/metrics``."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from prometheus_client import CollectorRegistry, Counter

from tierstore import TieredWriter
from tierstore.cli import main
from tierstore.config import Config, config_from_dict
from tierstore.promote.endpoint import serve
from tierstore.promote.health import MIN_STALL_BOUND, PromoterHealth, stall_bound
from tierstore.promote.sidecar import Promoter


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(url: str) -> tuple[int, str]:
    """Status and body of a GET, 5xx answers included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - http://127.0.0.1
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize(
    ("interval", "bound"), [(0.5, MIN_STALL_BOUND), (10.0, MIN_STALL_BOUND), (30.0, 300.0), (60.0, 600.0)]
)
def test_stall_bound_is_ten_intervals_but_never_below_the_floor(interval: float, bound: float) -> None:
    assert stall_bound(interval) == bound


def test_liveness_fails_only_after_the_bound_without_a_heartbeat() -> None:
    clock = FakeClock()
    health = PromoterHealth(60.0, clock=clock)
    clock.now += 60.0
    assert health.liveness().ok  # exactly at the bound: still alive
    clock.now += 1.0
    verdict = health.liveness()
    assert not verdict.ok
    assert verdict.reason.startswith("stuck: no progress for 61 s")
    health.beat()
    assert health.liveness().ok


def test_readiness_waits_for_a_finished_pass_and_reports_a_failed_one() -> None:
    clock = FakeClock()
    health = PromoterHealth(60.0, clock=clock)
    assert health.readiness() == health.readiness()  # stable without heartbeats
    assert not health.readiness().ok
    health.pass_failed("cannot list tier s3\nconnection refused")
    verdict = health.readiness()
    assert not verdict.ok
    assert "last pass failed: cannot list tier s3; connection refused" in verdict.reason
    assert health.liveness().ok  # an outage is not a hang: a restart would not cure it
    health.pass_finished()
    assert health.readiness().ok
    clock.now += 61.0
    assert not health.readiness().ok  # a stuck promoter is not ready either


@pytest.fixture
def served() -> Iterator[tuple[FakeClock, PromoterHealth, str]]:
    clock = FakeClock()
    health = PromoterHealth(60.0, clock=clock)
    registry = CollectorRegistry()
    Counter("tierstore_probe_test", "a metric to find", registry=registry).inc()
    server = serve(registry, health, 0, "127.0.0.1")
    try:
        yield clock, health, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_probes_answer_200_or_503_with_a_one_line_reason(
    served: tuple[FakeClock, PromoterHealth, str],
) -> None:
    clock, health, base = served
    assert get(f"{base}/healthz") == (200, "ok: last progress 0 s ago\n")
    status, body = get(f"{base}/readyz")
    assert (status, body) == (503, "not ready: no pass finished yet\n")
    health.pass_finished()
    assert get(f"{base}/readyz") == (200, "ready: 1 passes finished\n")
    clock.now += 120.0
    status, body = get(f"{base}/healthz")
    assert status == 503
    assert body.count("\n") == 1 and body.startswith("stuck: no progress for 120 s")
    assert get(f"{base}/readyz")[0] == 503


def test_metrics_are_still_served_beside_the_probes(served: tuple[FakeClock, PromoterHealth, str]) -> None:
    _clock, _health, base = served
    status, body = get(f"{base}/metrics")
    assert status == 200
    assert "tierstore_probe_test_total 1.0" in body


def test_a_promoter_is_ready_after_its_first_pass(make_config: Callable[..., Config]) -> None:
    promoter = Promoter(make_config("memory", "local", promote={"interval": "1s"}))
    port = promoter.serve(0, "127.0.0.1")
    assert promoter.health.stall_after == MIN_STALL_BOUND
    assert get(f"http://127.0.0.1:{port}/readyz")[0] == 503
    promoter.run_once()
    assert get(f"http://127.0.0.1:{port}/readyz")[0] == 200
    assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200


def test_copying_a_checkpoint_beats_for_every_chunk(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local")
    state = {"w": torch.randn(4096), "step": 1}
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="step_0001")
    promoter = Promoter(config)
    callers: list[str] = []
    original = promoter.health.beat

    def counted() -> None:
        # who beat: the pass, or a copy (through the promote duty's progress, which also feeds
        # the deadline on a copy's progress)
        caller = sys._getframe(1)
        callers.extend((caller.f_code.co_name, caller.f_back.f_code.co_name if caller.f_back else ""))
        original()

    promoter.health.beat = counted  # type: ignore[method-assign]
    assert promoter.run_once().promoted  # the checkpoint was copied to the local tier
    assert "copied_chunk" in callers, callers


def misconfigured_s3(tmp_path: Path, s3_endpoint: str, bucket: str) -> dict[str, Any]:
    """A local tier and an S3 tier whose bucket may not exist."""
    return {
        "tiers": [
            {"name": "local", "type": "local", "path": str(tmp_path / "local")},
            {"name": "s3", "type": "s3", "url": f"s3://{bucket}/run", "endpoint_url": s3_endpoint},
        ],
        "probe_timeout": "5s",
    }


def test_a_missing_bucket_keeps_the_promoter_not_ready_until_it_exists(
    tmp_path: Path, s3_endpoint: str, s3_client: Any
) -> None:
    """Not an outage: /readyz fails while the bucket is missing, naming it, and passes once it is
    there; /healthz stays alive (a restart would not cure it)."""
    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    promoter = Promoter(config_from_dict(misconfigured_s3(tmp_path, s3_endpoint, bucket)))
    port = promoter.serve(0, "127.0.0.1")
    promoter.run_once()
    code, why = get(f"http://127.0.0.1:{port}/readyz")
    assert code == 503 and f"bucket '{bucket}' does not exist" in why and "tier s3" in why
    assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    s3_client.create_bucket(Bucket=bucket)
    promoter.run_once()
    assert get(f"http://127.0.0.1:{port}/readyz")[0] == 200


def test_the_promoter_stops_at_start_on_a_missing_bucket(
    tmp_path: Path, s3_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tierstore.yaml"
    config.write_text(yaml.safe_dump(misconfigured_s3(tmp_path, s3_endpoint, "nobucket")))
    assert main(["--config", str(config), "promote", "--once"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "tier s3 refuses, and waiting will not change it" in err and "'nobucket' does not exist" in err


def test_ls_lists_what_it_can_and_fails_on_a_missing_bucket(
    tmp_path: Path, s3_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outage is reported and ``ls`` goes on (exit 0); a tier that refuses for good fails it."""
    config = tmp_path / "tierstore.yaml"
    config.write_text(yaml.safe_dump(misconfigured_s3(tmp_path, s3_endpoint, "nobucket")))
    assert main(["--config", str(config), "ls"]) == 2
    captured = capsys.readouterr()
    assert "tier s3 refuses (a configuration to fix), not listed" in captured.err
    assert "no committed checkpoints" in captured.out
