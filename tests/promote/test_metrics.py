"""The promoter's own metrics beyond the counters: per-tier ages, and what the probes answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter
from tierstore.config import Config, config_from_dict
from tierstore.promote.health import PromoterHealth
from tierstore.promote.metrics import PromoterMetrics
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust


def test_every_tier_reports_the_age_of_its_newest_checkpoint(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local")
    dcp.save({"w": torch.randn(256)}, storage_writer=TieredWriter(config), checkpoint_id="step_1")
    started = read_manifest(config.make_tier("memory", node=0), "step_1", trust=MarkerTrust()).timings[
        "started_at"
    ]
    promoter = Promoter(config, node=0)
    promoter.run_once()
    sample = promoter.metrics.registry.get_sample_value
    for tier in ("memory", "local"):
        before = time.time()
        age = sample("tierstore_newest_checkpoint_age_seconds", {"tier": tier})
        assert age is not None
        assert before - started <= age <= time.time() - started  # computed as the scrape asks
    lag = sample("tierstore_recovery_point_lag_seconds")
    local = sample("tierstore_newest_checkpoint_age_seconds", {"tier": "local"})
    assert lag is not None and local is not None and abs(lag - local) < 1.0


def test_the_recovery_point_lag_grows_between_passes_and_counts_before_anything_is_durable(
    make_config: Callable[..., Config],
) -> None:
    """During an outage passes are far apart: the lag is computed at each scrape. With nothing in the
    durable tier yet it runs from the oldest checkpoint seen, not 0 (which hid a job at risk)."""
    config = make_config("memory", "local", tiers={"local": {"every": 1000}})
    dcp.save({"w": torch.randn(256)}, storage_writer=TieredWriter(config), checkpoint_id="step_1")
    started = read_manifest(config.make_tier("memory", node=0), "step_1", trust=MarkerTrust()).timings[
        "started_at"
    ]
    promoter = Promoter(config, node=0)
    promoter.run_once()
    sample = promoter.metrics.registry.get_sample_value
    assert not config.make_tier("local", node=0).exists("step_1/commit.json"), "nothing durable yet"
    first = sample("tierstore_recovery_point_lag_seconds")
    assert first is not None and first > 0 and abs(first - (time.time() - started)) < 1.0
    time.sleep(0.3)
    later = sample("tierstore_recovery_point_lag_seconds")
    assert later is not None and later >= first + 0.25, "grew without a pass"


def test_a_tier_without_a_checkpoint_reports_no_age(make_config: Callable[..., Config]) -> None:
    promoter = Promoter(make_config("memory", "local"), node=0)
    promoter.run_once()
    sample = promoter.metrics.registry.get_sample_value
    assert sample("tierstore_newest_checkpoint_age_seconds", {"tier": "memory"}) is None
    assert sample("tierstore_newest_checkpoint_age_seconds", {"tier": "local"}) is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_probes_answers_are_gauges_asked_at_each_scrape() -> None:
    clock = FakeClock()
    health = PromoterHealth(300.0, clock=clock)
    metrics = PromoterMetrics()
    metrics.watch(health, None)
    sample = metrics.registry.get_sample_value
    assert (sample("tierstore_promoter_live"), sample("tierstore_promoter_ready")) == (1, 0)
    health.pass_failed("cannot list tier s3")
    health.pass_finished()
    health.pass_finished()
    assert (sample("tierstore_promoter_live"), sample("tierstore_promoter_ready")) == (1, 1)
    assert sample("tierstore_promoter_passes_total") == 2
    assert sample("tierstore_promoter_failed_passes_total") == 1
    clock.now += 301.0  # the loop is wedged; the HTTP thread still answers
    assert (sample("tierstore_promoter_live"), sample("tierstore_promoter_ready")) == (0, 0)


def test_the_backlog_counts_what_waits_for_a_tier_that_is_away(tmp_path: Path) -> None:
    """During an S3 outage the checkpoints due there queue: the backlog says so (it read 0)."""
    config = config_from_dict(
        {
            "tiers": [
                {"name": "ram", "type": "memory", "path": str(tmp_path / "ram")},
                {
                    "name": "s3",
                    "type": "s3",
                    "url": "s3://away/run",
                    "endpoint_url": "http://127.0.0.1:9",
                    "max_attempts": 1,
                },
            ],
            "probe_timeout": "2s",
        }
    )
    for step in (1, 2):
        dcp.save({"w": torch.randn(64)}, storage_writer=TieredWriter(config), checkpoint_id=f"step_{step}")
    promoter = Promoter(config, node=0)
    promoter.run_once()
    assert "s3" in promoter.unreachable
    assert promoter.metrics.registry.get_sample_value("tierstore_promotion_backlog", {"tier": "s3"}) == 2.0
