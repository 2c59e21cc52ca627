"""Tiers stand alone: an S3 outage never stops a save, a restore or a restart, with real faults.

The S3 tier's endpoint is a loopback TCP fault proxy (``tests/fault_proxy.py``) in front of a real
S3 server: SeaweedFS for the three fault modes (connection refused, an endpoint that accepts and never
answers, every request answered 503 SlowDown), moto for one quick-lane run. Nothing in tierstore is
patched. For each mode, the fault is there before the job starts, or appears mid-run, then goes away:

* saves into the memory tier keep committing, and make no request to S3 (the proxy counts them);
* a restart resumes from the newest checkpoint its reachable tiers hold, saying which tier it could
  not reach; a restore from memory asks nothing of S3 once the promoter has sighted it;
* the promoter keeps copying to the tiers that work, reports the tier (``tierstore_tier_unavailable``)
  and a growing recovery-point lag, and catches up once the tier is back, every copy verified;
* retention never removes the newest checkpoint that has not reached S3.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.fault_proxy import FaultProxy
from tests.s3server import SeaweedServer
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore._platform import health
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.records import known
from tierstore.records.catalog import Catalog
from tierstore.records.marker import copy_problems, read_manifest
from tierstore.signing import MarkerTrust

FAULTS = ["refuse", "hang", "503"]


@pytest.fixture
def proxied_s3(seaweed: SeaweedServer, seaweed_bucket: str) -> Iterator[tuple[FaultProxy, str]]:
    """``(proxy, bucket)``: a fault proxy in front of the real S3 server (SeaweedFS)."""
    endpoint = urlparse(seaweed.endpoint)
    assert endpoint.hostname is not None and endpoint.port is not None
    with FaultProxy(endpoint.hostname, endpoint.port) as proxy:
        yield proxy, seaweed_bucket


@pytest.fixture
def proxied_moto(s3_endpoint: str, s3_bucket: str) -> Iterator[tuple[FaultProxy, str]]:
    """``(proxy, bucket)``: a fault proxy in front of moto's server (the quick lane)."""
    endpoint = urlparse(s3_endpoint)
    assert endpoint.hostname is not None and endpoint.port is not None
    with FaultProxy(endpoint.hostname, endpoint.port) as proxy:
        yield proxy, s3_bucket


def outage_config(tmp_path: Path, proxy: FaultProxy, bucket: str) -> Config:
    """memory (keep 2) -> local (keep 3) -> s3 behind the proxy; short deadlines for the tests."""
    return config_from_dict(
        {
            "tiers": [
                {"name": "ram", "type": "memory", "path": str(tmp_path / "ram"), "keep": 2},
                {"name": "disk", "type": "local", "path": str(tmp_path / "disk"), "keep": 3},
                {
                    "name": "s3",
                    "type": "s3",
                    "url": f"s3://{bucket}/run",
                    "endpoint_url": proxy.endpoint,
                    "max_attempts": 2,
                    "max_retry_time": "2s",
                    "read_timeout": "3s",
                    "part_size": "5MiB",
                },
            ],
            "probe_timeout": "1500ms",
            "promote": {"interval": "1s", "activity_ttl": "5s"},
        }
    )


def state_at(step: int) -> dict[str, Any]:
    """A small state whose bytes say which step it is."""
    return {"w": torch.full((50_000,), float(step)), "step": step}


def save(config: Config, step: int) -> None:
    dcp.save(state_at(step), storage_writer=TieredWriter(config), checkpoint_id=f"step_{step:04d}")


def restored_step(config: Config, checkpoint_id: str) -> tuple[int, str]:
    """``(step, tier)`` restored bit-exact for ``checkpoint_id``."""
    target = {"w": torch.zeros(50_000), "step": -1}
    reader = TieredReader(config)
    dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
    step = int(target["step"])
    assert torch.equal(target["w"], state_at(step)["w"]), "restored bytes are the saved ones"
    assert reader.chosen_tier is not None
    return step, reader.chosen_tier


def requests_to(proxy: FaultProxy) -> int:
    """Connections the proxy has accepted, whatever its mode (each is a request, or a pool)."""
    return sum(proxy.accepted.values())


def committed(config: Config, tier_name: str) -> list[str]:
    tier = config.make_tier(tier_name, node=0)
    return sorted(c for c in tier.list_dir("") if tier.exists(f"{c}/commit.json"))


def assert_verified(config: Config, tier_name: str) -> None:
    """Every copy committed in the tier matches its marker byte for byte (CRC32C)."""
    tier = config.make_tier(tier_name, node=0)
    for checkpoint_id in committed(config, tier_name):
        manifest = read_manifest(tier, checkpoint_id, trust=MarkerTrust())
        assert copy_problems(tier, manifest, verify=True) == [], checkpoint_id


def lag(promoter: Promoter) -> float:
    value = promoter.metrics.registry.get_sample_value("tierstore_recovery_point_lag_seconds")
    return -1.0 if value is None else value


def away(promoter: Promoter) -> float | None:
    sample = promoter.metrics.registry.get_sample_value
    return sample("tierstore_tier_unavailable", {"tier": "s3"})


def probes_done(timeout: float = 60.0) -> None:
    """Wait until no abandoned tier probe (tierstore._platform.bounded) of this process is still running:
    its late requests belong to the look that started it, not to what the test does next."""
    deadline = time.monotonic() + timeout
    while any(t.name.startswith("tierstore-probe-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a tier probe never ended"
        time.sleep(0.05)


def outage_scenario(
    config: Config, proxy: FaultProxy, fault: str, *, from_start: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole story for one fault mode (see the module docstring)."""
    promoter = Promoter(config)
    step = 0
    if not from_start:  # healthy first: two saves reach S3, and the promoter sights it
        for step in (1, 2):
            save(config, step)
        promoter.run_once()
        assert committed(config, "s3") == ["step_0001", "step_0002"]
        proxy.set_mode(fault)
    else:
        proxy.set_mode(fault)
    # Saves keep committing into memory, asking nothing of S3 (past the process's one start-up look).
    save(config, step + 1)
    probes_done()  # a start-up look abandoned after probe_timeout may still be retrying S3
    before = requests_to(proxy)
    for later in range(step + 2, step + 6):
        save(config, later)
    newest = f"step_{step + 5:04d}"
    assert requests_to(proxy) == before, "a save into memory made a request to S3"
    assert read_manifest(config.make_tier("ram", node=0), newest, trust=MarkerTrust()).seq is not None
    # The promoter goes on with the disk tier and reports S3 away; the lag grows.
    promoter.run_once()
    assert away(promoter) == 1
    assert newest in committed(config, "disk")
    first_lag = lag(promoter)
    time.sleep(0.05)
    promoter.run_once()
    if not from_start:
        assert lag(promoter) > first_lag, "the recovery-point lag grows while S3 is away"
    # Retention trimmed memory to its keep, and never the newest checkpoint S3 lacks.
    ram = committed(config, "ram")
    assert newest in ram and len(ram) <= 2
    # A restart (a new process's view: no knowledge carried over) resumes from what it can reach.
    health.view()._forget()
    known._KNOWN.get().clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert latest_committed(config, collective=False) == newest
        assert restored_step(config, newest) == (step + 5, "ram")
    if from_start:  # never sighted: the restart had to ask S3, and says it could not
        assert "tier s3" in caplog.text and "unreachable" in caplog.text
    else:  # sighted by the promoter before the outage: nothing asked of S3
        before = requests_to(proxy)
        assert latest_committed(config, collective=False) == newest
        assert restored_step(config, newest)[1] == "ram"
        assert requests_to(proxy) == before, "a restore from memory made a request to S3"
    listing = Catalog(config)
    assert newest in [entry.checkpoint_id for entry in listing.listings()]
    assert "s3" in listing.unreachable
    # The tier comes back: the promoter catches up, every copy verified.
    proxy.set_mode("pass")
    deadline = time.monotonic() + 30
    while newest not in committed(config, "s3") and time.monotonic() < deadline:
        promoter.run_once()
    assert newest in committed(config, "s3"), "the promoter caught up once S3 was back"
    assert away(promoter) == 0
    assert_verified(config, "s3")
    if from_start:
        assert 0 <= lag(promoter) < 60, "the lag is measured once something is durable"
    else:  # measured from the newest save now, no longer from the last one before the outage
        s3 = config.make_tier("s3", node=0)
        started = read_manifest(s3, "step_0002", trust=MarkerTrust()).timings["started_at"]
        assert started is not None and lag(promoter) < time.time() - started


@pytest.mark.parametrize("from_start", [True, False], ids=["before-start", "mid-run"])
@pytest.mark.parametrize("fault", FAULTS)
def test_an_s3_outage_stops_nothing_on_the_fast_path(
    fault: str,
    from_start: bool,
    tmp_path: Path,
    proxied_s3: tuple[FaultProxy, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy, bucket = proxied_s3
    config = outage_config(tmp_path, proxy, bucket)
    outage_scenario(config, proxy, fault, from_start=from_start, caplog=caplog)


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_refused_connections_stop_nothing_on_the_fast_path_quick(
    tmp_path: Path, proxied_moto: tuple[FaultProxy, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The same story against moto, in the quick lane: one mode, the fault appearing mid-run."""
    proxy, bucket = proxied_moto
    config = outage_config(tmp_path, proxy, bucket)
    outage_scenario(config, proxy, "refuse", from_start=False, caplog=caplog)
