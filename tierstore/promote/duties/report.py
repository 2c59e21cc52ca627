"""Report: how old the newest checkpoint of each tier is (the durable tier's: the recovery-point
lag), and how each pass ended, where ``tierstore status`` reads it
(:mod:`tierstore.records.promoter_state`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from tierstore._platform.health import said_once
from tierstore.errors import TierstoreError
from tierstore.promote.discovery import SeenCopy
from tierstore.promote.duties import Context, Outcome, logger
from tierstore.promote.policy import Promotion
from tierstore.promote.view import View
from tierstore.records.promoter_state import PromoterState, write_state

_NEVER = float("inf")


def _started(seen: SeenCopy) -> float:
    return seen.started_at or seen.copy.committed_at


class Report:
    """The duty, with what it keeps between passes."""

    def __init__(self) -> None:
        self._newest_starts: dict[str, float] = {}
        """When the newest checkpoint seen in each tier was started (kept while a tier is away)."""
        self._oldest_start = _NEVER
        self._exported: set[str] = set()
        self._lag_exported = False
        self._started_at = time.time()
        self._passes = 0

    def run(self, view: View, ctx: Context) -> Outcome:
        """The age gauges, computed at each scrape (they grow between passes, and while a tier cannot
        be listed the last checkpoint seen there is still the newest known). With nothing durable
        yet, the recovery-point lag runs from the oldest checkpoint this node has seen committed
        anywhere: all the work since then is what a loss would redo, not 0."""
        for tier in ctx.tiers:
            starts = [_started(s) for s in view.found.get(tier.name, {}).values() if s.committed]
            if starts:
                self._newest_starts[tier.name] = max(starts)
                self._oldest_start = min([self._oldest_start, *starts])
            if tier.name in self._newest_starts and tier.name not in self._exported:
                self._exported.add(tier.name)
                ctx.metrics.newest_age.labels(tier.name).set_function(self._age(tier.name))
        if not self._lag_exported and (
            ctx.tiers[-1].name in self._newest_starts or self._oldest_start < _NEVER
        ):
            self._lag_exported = True
            lag = self._age(ctx.tiers[-1].name, fallback=True)
            ctx.metrics.durable_age.set_function(lag)
            ctx.metrics.recovery_point_lag.set_function(lag)
        return Outcome()

    def _age(self, tier: str, *, fallback: bool = False) -> Callable[[], float]:
        """Seconds since the newest checkpoint of ``tier`` started, asked at each scrape (with
        ``fallback``, since the oldest seen anywhere while ``tier`` has none)."""

        def age() -> float:
            start = self._newest_starts.get(tier, self._oldest_start if fallback else _NEVER)
            return max(0.0, time.time() - start) if start < _NEVER else 0.0

        return age

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
                ctx.ask(tier, functools.partial(write_state, tier, state), what="record the promoter's state")
            except (TierstoreError, OSError) as exc:
                where = (tier.name, exc)
                logger.log(said_once(tier), "cannot record the promoter's state in tier %s: %s", *where)
