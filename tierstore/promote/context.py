"""What every duty of the promoter is handed beside its view (:mod:`tierstore.promote.duties`): the
:class:`Context` made once per promoter, the tiers' :class:`Availability`, and the promoter's log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from tierstore._platform.bounded import Blame, Prober, unwatched
from tierstore.config import Config
from tierstore.promote.discovery import MarkerCache
from tierstore.promote.health import PromoterHealth, stall_bound
from tierstore.promote.keeper import Keepers
from tierstore.promote.metrics import PromoterMetrics
from tierstore.promote.rules import rules_of
from tierstore.tiers import Tier, is_host_memory

T = TypeVar("T")
Progress = Callable[[int], None]
"""What bounded work calls as it goes (``progress(n)``: n more bytes or items done)."""

logger = logging.getLogger("tierstore.promote.sidecar")
"""The promoter's log, every duty's: one name for operators to raise to INFO for its events."""


def event(name: str, level: int = logging.INFO, /, **fields: object) -> None:
    """One structured log line: ``name key=value ...`` (logfmt), at INFO unless ``level``."""
    logger.log(level, " ".join([name, *(f"{k}={_fmt(v)}" for k, v in fields.items())]))


def _fmt(value: object) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return f'"{text}"' if " " in text else text


class Availability:
    """Which tiers the promoter cannot list (as the last look found) or that refuse writes (as the
    last promotion into each found; retried every pass): the one thing duties share that outlives
    a view. Each change is an event and the ``tierstore_tier_unavailable`` gauge."""

    def __init__(self, metrics: PromoterMetrics, health: PromoterHealth) -> None:
        self.metrics, self.health = metrics, health
        self.unreachable: dict[str, str] = {}
        self.unavailable: set[str] = set()
        self.misconfigured: dict[tuple[str, str], str] = {}
        """``{(tier, "list" or "write"): why}``: tiers that refused for a reason waiting will not
        cure (a missing bucket, refused credentials); the promoter is not ready while one stands."""

    def set_misconfigured(self, tier_name: str, doing: str, error: str | None) -> None:
        """Record that ``doing`` (``list``, ``write``) in a tier was refused for good (``error``: a
        TierMisconfiguredError's) or succeeded (None)."""
        if error is None:
            self.misconfigured.pop((tier_name, doing), None)
        else:
            self.misconfigured[(tier_name, doing)] = error
        self.health.misconfigured({tier: why for (tier, _doing), why in self.misconfigured.items()})

    def set_unreachable(self, tier_name: str, error: str | None) -> None:
        """Record that a tier cannot be listed (``error``) or can again (None)."""
        was = tier_name in self.unreachable
        if error is not None:
            self.unreachable[tier_name] = error
            if not was:
                event("tier_unreachable", tier=tier_name, error=error.replace("\n", "; "))
                logger.error("tier %s is unreachable; the other tiers go on without it: %s", tier_name, error)
        elif was:
            del self.unreachable[tier_name]
            event("tier_reachable", tier=tier_name)
        self._export(tier_name)

    def set_unavailable(self, tier_name: str, error: str | None) -> None:
        """Record that a tier refuses writes (``error``) or takes them again (None)."""
        was = tier_name in self.unavailable
        if error is not None:
            self.unavailable.add(tier_name)
            if not was:
                event("tier_unavailable", tier=tier_name, error=error.replace("\n", "; "))
                logger.error("tier %s refuses writes, promotion routes around it: %s", tier_name, error)
        elif was:
            self.unavailable.discard(tier_name)
            event("tier_available", tier=tier_name)
        self._export(tier_name)

    def _export(self, tier_name: str) -> None:
        away = tier_name in self.unavailable or tier_name in self.unreachable
        self.metrics.unavailable.labels(tier_name).set(1 if away else 0)


class Context:
    """What every duty is handed beside the view: the configuration, this node's tiers (fastest
    first; the last is the durable tier) and this promoter's services, made and wired once (the
    metrics answer the health probes and count each tier's retries). Every question a duty asks a
    tier goes through :meth:`bounded`; a duty only beats ``health`` (a long copy is progress, not a
    hung promoter)."""

    def __init__(self, config: Config, node: int, metrics: PromoterMetrics) -> None:
        self.config, self.node, self.metrics = config, node, metrics
        self.rules = rules_of(config)
        self.tiers = tuple(
            config.make_tiers(node=node, on_retry=lambda name, _error: metrics.retries.labels(name).inc())
        )
        self.trust = config.marker_trust()
        self.by_name = {t.name: t for t in self.tiers}
        self.health = PromoterHealth(stall_bound(config.promote.interval))
        metrics.watch(self.health, config.metrics.directory_for(node), stale_after=config.metrics.stale_after)
        self.stopping, self.cancel = threading.Event(), threading.Event()
        self.prober = Prober(config.probe_timeout)
        self.hanging: set[tuple[str, ...]] = set()
        """Promotions given up on whose copy still waits on a tier (not tried again until it ends)."""
        self.cache = MarkerCache(self.trust)
        self.swept: dict[str, float] = {}
        """When (monotonic) each tier's last complete cleanup ended, as far as this promoter knows
        (:mod:`tierstore.promote.duties.collect`)."""
        self.availability = Availability(metrics, self.health)
        self.failing: dict[tuple[str, str, str, str], str] = {}
        """``{(id, generation, source, target): error class}``: promotions whose last try failed,
        told at ERROR once; each pass's retry failing alike is DEBUG (a corrupt source fails for good)."""
        # A keeper that passes lists its tier at least once per full_scan, and indexes it: an
        # index older than that and a pass is a stalled loop's (Keeper.indexed).
        index_life = config.promote.full_scan + config.promote.interval
        self.keepers = Keepers(
            self.tiers, node, config.promote.keeper_lease, self.prober, _keeper_event, index_life=index_life
        )
        """The lease of each job-wide tier (:mod:`tierstore.promote.keeper`): whether this node keeps it."""
        for name, keeper in self.keepers.by_tier.items():
            metrics.keeper.labels(name).set_function(keeper.keeps)
        metrics.start_at_zero(t.name for t in self.tiers)

    def bounded(
        self, tier: Tier, work: Callable[[Progress], T], *, what: str, blame: Blame | None = None
    ) -> T:
        """``work(progress)`` on ``tier`` with a deadline on its progress (:meth:`Prober.watch
        <tierstore._platform.bounded.Prober.watch>`): ``probe_timeout`` without a ``progress``
        call, or before the first (a short question calls none: its answer is due within it), is a
        hung tier: :class:`~tierstore.errors.TierUnavailableError`, and the health view skips the
        tier (its one WARNING names it) until a background probe finds it back. So a tier that
        hangs mid-pass costs the pass one deadline, and the other tiers go on. ``what`` says what
        was asked. Host memory cannot hang: asked on this thread, with no deadline."""
        if is_host_memory(tier):
            return work(unwatched)
        return self.prober.watch(tier, work, what=what, blame=blame)

    def ask(self, tier: Tier, question: Callable[[], T], *, what: str) -> T:
        """:meth:`bounded` for a question that makes no progress of its own on the way (a listing
        inside it tells its pages and directories: :func:`~tierstore._platform.bounded.beat`)."""
        return self.bounded(tier, lambda _count: question(), what=what)


def _keeper_event(name: str, tier: str, epoch: int, why: str) -> None:
    """``keeper_taken`` / ``keeper_lost``: one INFO line each, with the epoch."""
    event(name, tier=tier, epoch=epoch, reason=why)
