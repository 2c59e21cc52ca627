"""Prometheus metrics of the promoter (``tierstore promote --metrics-port N``).

One registry per promoter, no module-level state. Served over HTTP at ``/metrics`` (by
:mod:`tierstore.promote.endpoint`, beside the ``/healthz`` and ``/readyz`` probes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierstore.promote.endpoint import serve


class PromoterMetrics:
    """Counters and gauges the promoter updates as it works."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_promoted = Counter(
            "tierstore_promoted_bytes",
            "Bytes copied into a tier by promotion",
            ["tier"],
            registry=r,
        )
        self.checkpoints_promoted = Counter(
            "tierstore_promoted_checkpoints", "Checkpoints committed in a tier by promotion", ["tier"],
            registry=r,
        )  # fmt: skip
        self.promotion_seconds = Histogram(
            "tierstore_promotion_duration_seconds", "Time to promote one checkpoint", ["tier"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r,
        )  # fmt: skip
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
            "tierstore_deleted_checkpoints",
            "Checkpoints deleted by retention",
            ["tier"],
            registry=r,
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
        self.last_pass = Gauge(
            "tierstore_last_pass_timestamp_seconds", "When the promoter last finished a pass",
            registry=r,
        )  # fmt: skip

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (port 0 picks a free one); return the port.

        Metrics only: :meth:`tierstore.promote.sidecar.Promoter.serve` adds the probes."""
        return int(serve(self.registry, None, port, addr).server_port)
