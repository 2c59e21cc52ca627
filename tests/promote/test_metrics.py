"""The promoter's own metrics beyond the counters: per-tier ages, and what the probes answer."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter
from tierstore.config import Config
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
    now = time.time()
    for tier in ("memory", "local"):
        age = sample("tierstore_newest_checkpoint_age_seconds", {"tier": tier})
        assert age is not None
        assert now - started - 5 <= age <= now - started
    lag = sample("tierstore_recovery_point_lag_seconds")
    assert lag == sample("tierstore_newest_checkpoint_age_seconds", {"tier": "local"})


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
