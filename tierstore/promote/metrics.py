"""Prometheus metrics of the promoter (``tierstore promote --metrics-port N``).

One registry per promoter, no module-level state. Served over HTTP at ``/metrics`` (by
:mod:`tierstore.promote.endpoint`, beside the ``/healthz`` and ``/readyz`` probes). Once the promoter
is watched (:meth:`PromoterMetrics.watch`), the registry also answers what the probes answer, as
gauges, and the node's trainer-side metrics: every rank's file in ``metrics.directory``
(:mod:`tierstore._platform.save_metrics`), read at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierstore._platform.save_metrics import read_directory
from tierstore.promote.endpoint import serve
from tierstore.promote.health import PromoterHealth


class PromoterMetrics:
    """Counters and gauges the promoter updates as it works."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_promoted = Counter(
            "tierstore_promoted_bytes", "Bytes copied into a tier by promotion", ["tier"], registry=r
        )
        self.checkpoints_promoted = Counter(
            "tierstore_promoted_checkpoints",
            "Checkpoints committed in a tier by promotion",
            ["tier"],
            registry=r,
        )
        self.promotion_seconds = Histogram(
            "tierstore_promotion_duration_seconds",
            "Time to promote one checkpoint",
            ["tier"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.failures = Counter(
            "tierstore_promotion_failures", "Promotions that failed", ["tier"], registry=r
        )
        self.retries = Counter(
            "tierstore_retries", "Requests retried after a transient error", ["tier"], registry=r
        )
        self.backlog = Gauge(
            "tierstore_promotion_backlog", "Promotions waiting to be done", ["tier"], registry=r
        )
        self.unavailable = Gauge(
            "tierstore_tier_unavailable",
            "1 while a tier cannot be listed (unreachable, hung) or refuses writes (full, read-only):"
            " promotion routes around it",
            ["tier"],
            registry=r,
        )
        self.deleted = Counter(
            "tierstore_deleted_checkpoints", "Checkpoints deleted by retention", ["tier"], registry=r
        )
        self.durable_age = Gauge(
            "tierstore_newest_durable_age_seconds",
            "Age of the newest checkpoint committed in the last (durable) tier: the recovery-point lag",
            registry=r,
        )
        self.mirrored = Gauge(
            "tierstore_mirror_redundant",
            "1 when this node's files of the newest checkpoint in a mirrored memory tier are held"
            " in a partner node's memory; 0 is reduced redundancy (the next save tries again)",
            ["tier"],
            registry=r,
        )
        self.conflicts = Gauge(
            "tierstore_conflicts",
            "Copies kept beside another content of their id in a lower tier (settle by hand)",
            ["tier"],
            registry=r,
        )
        self.recovery_point_lag = Gauge(
            "tierstore_recovery_point_lag_seconds",
            "Seconds since the newest checkpoint known to be in the durable (last) tier was"
            " started; grows while that tier is away",
            registry=r,
        )
        self.newest_age = Gauge(
            "tierstore_newest_checkpoint_age_seconds",
            "Seconds since the newest checkpoint seen committed in a tier was started (this node's"
            " view); grows while the tier is away or nothing newer reaches it",
            ["tier"],
            registry=r,
        )
        self.keeper = Gauge(
            "tierstore_keeper",
            "1 while this promoter keeps a job-wide tier (holds its lease, within its deadline):"
            " it alone lists, promotes into, retains and cleans it; summed over the job, 1 per tier",
            ["tier"],
            registry=r,
        )
        self.last_pass = Gauge(
            "tierstore_last_pass_timestamp_seconds", "When the promoter last finished a pass", registry=r
        )
        self._watching: list[Collector] = []

    def start_at_zero(self, tiers: Iterable[str]) -> None:
        """Make every counter's series of each tier exist at 0 now, at the promoter's start: a series
        that appears only at its first increment is invisible to ``increase()``, so the first
        failure would fire no alert."""
        for tier in tiers:
            for counter in (self.bytes_promoted, self.checkpoints_promoted, self.failures, self.retries):
                counter.labels(tier)
            self.deleted.labels(tier)

    def watch(self, health: PromoterHealth, trainer_files: str | None, *, stale_after: float = 0.0) -> None:
        """Export ``health`` at every scrape, and the trainer-side files in ``trainer_files`` (a
        directory; None: none). Watching again replaces what was watched."""
        for collector in self._watching:
            self.registry.unregister(collector)
        self._watching = [_HealthCollector(health)]
        self.registry.register(self._watching[0])
        if trainer_files is not None:
            own = {name for metric in self.registry.collect() for name in _names(metric)}
            self._watching.append(_TrainerFiles(trainer_files, stale_after, own))
            self.registry.register(self._watching[1])

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (port 0 picks a free one); return the port.

        Metrics only: :meth:`tierstore.promote.sidecar.Promoter.serve` adds the probes."""
        return int(serve(self.registry, None, port, addr).server_port)


def _names(metric: Metric) -> set[str]:
    return {metric.name, *(sample.name for sample in metric.samples)}


class _HealthCollector:
    """The probes' answers and the pass counts of one promoter loop, as asked at each scrape: the
    loop may be wedged while the HTTP thread still answers, so these are computed, not stored."""

    def __init__(self, health: PromoterHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        finished, failed = self.health.passes()
        yield GaugeMetricFamily(
            "tierstore_promoter_live",
            "1 while the promoter loop makes progress within its bound (what /healthz answers); 0: stuck",
            value=1 if self.health.liveness().ok else 0,
        )
        yield GaugeMetricFamily(
            "tierstore_promoter_ready",
            "1 once a pass has finished and while the loop is live (what /readyz answers)",
            value=1 if self.health.readiness().ok else 0,
        )
        yield CounterMetricFamily(
            "tierstore_promoter_passes", "Promoter passes that ran to their end", value=finished
        )
        yield CounterMetricFamily(
            "tierstore_promoter_failed_passes",
            "Promoter passes that ended with an error (retried after promote.interval)",
            value=failed,
        )


class _TrainerFiles:
    """The trainer-side metrics of this node's ranks, read from their files at each scrape.

    Families the promoter itself exports are left out (a file must not shadow them)."""

    def __init__(self, directory: str, stale_after: float, reserved: set[str]) -> None:
        self.directory = directory
        self.stale_after = stale_after
        self.reserved = reserved

    def collect(self) -> Iterator[Metric]:
        for metric in read_directory(self.directory, stale_after=self.stale_after):
            if not _names(metric) & self.reserved:
                yield metric
