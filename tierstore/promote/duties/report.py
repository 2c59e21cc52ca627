"""Report: how old the newest checkpoint of each tier is (the durable tier's: the recovery-point
lag), and how each pass ended, where ``tierstore status`` reads it
(:mod:`tierstore.records.promoter_state`)."""

from __future__ import annotations

import time

from tierstore.errors import TierstoreError
from tierstore.promote.duties import Context, Outcome, logger
from tierstore.promote.policy import Promotion
from tierstore.promote.view import View
from tierstore.records.promoter_state import PromoterState, write_state


class Report:
    """The duty, with what it keeps between passes."""

    def __init__(self) -> None:
        self._newest_starts: dict[str, float] = {}
        """When the newest checkpoint seen in each tier was started (kept while a tier is away)."""
        self._started_at = time.time()
        self._passes = 0

    def run(self, view: View, ctx: Context) -> Outcome:
        """The age gauges. While a tier cannot be listed, the last checkpoint seen there is still
        the newest known, and its age grows."""
        now = time.time()
        for tier in ctx.tiers:
            starts = [
                float(s.manifest.timings.get("started_at") or s.copy.committed_at)
                for s in view.found.get(tier.name, {}).values()
                if s.manifest is not None
            ]
            if starts:
                self._newest_starts[tier.name] = max(starts)
            if tier.name in self._newest_starts:
                age = max(0.0, now - self._newest_starts[tier.name])
                ctx.metrics.newest_age.labels(tier.name).set(age)
        if ctx.tiers[-1].name in self._newest_starts:
            lag = max(0.0, now - self._newest_starts[ctx.tiers[-1].name])
            ctx.metrics.durable_age.set(lag)
            ctx.metrics.recovery_point_lag.set(lag)
        return Outcome()

    def record_state(
        self,
        ctx: Context,
        error: str | None,
        *,
        backlog: int,
        failed: list[tuple[Promotion, str]] | None = None,
    ) -> None:
        """Leave how a pass ended (``error``: it failed) in the node-local tiers this promoter looks
        after, or its first tier when it has none; advisory, never stops the promoter."""
        if error is None:
            self._passes += 1
        away = ctx.availability
        state = PromoterState(
            node=ctx.node,
            interval=ctx.config.promote.interval,
            stall_after=ctx.health.stall_after,
            passes=self._passes,
            last_error=None if error is None else error.replace("\n", "; "),
            unreachable=dict(away.unreachable),
            unavailable=tuple(sorted(away.unavailable)),
            backlog=backlog,
            started_at=self._started_at,
            failed=tuple(
                f"{p.checkpoint_id} {p.source}->{p.target}: {why}".replace("\n", "; ")
                for p, why in failed or ()
            ),
        )
        for tier in [t for t in ctx.tiers if t.node_local] or ctx.tiers[:1]:
            if tier.name in away.unreachable:
                continue
            try:
                write_state(tier, state)
            except (TierstoreError, OSError) as exc:
                logger.warning("cannot record the promoter's state in tier %s: %s", tier.name, exc)
