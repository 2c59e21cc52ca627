"""The promoter sidecar: ``tierstore --config FILE promote``, one per training node: the loop.

Each pass makes one view of every tier (:mod:`tierstore.promote.view`) and runs the duties over it in
their order (:mod:`tierstore.promote.duties`), every ``promote.interval``, and leaves how each ended
for ``tierstore status``; ``--metrics-port`` serves ``/metrics``, ``/healthz`` and ``/readyz``
(:mod:`tierstore.promote.health`). ``SIGTERM`` lets the files in flight finish within
``promote.grace_period``, then abandons them (no marker over partial data) and exits 0. Killed with
``kill -9``, a restart finishes or redoes the work; a rerun after success changes nothing.
"""

from __future__ import annotations

import dataclasses
import threading

from tierstore.config import Config
from tierstore.errors import TierstoreError
from tierstore.promote import duties
from tierstore.promote.cleanup import Cleanup
from tierstore.promote.discovery import SeenCopy
from tierstore.promote.duties import collect, conflicts, mirrors, promote, retain
from tierstore.promote.duties.confirm import ConfirmNumbers
from tierstore.promote.duties.report import Report
from tierstore.promote.duties.sightings import Sightings
from tierstore.promote.endpoint import serve
from tierstore.promote.metrics import PromoterMetrics
from tierstore.promote.policy import Deletion, Promotion
from tierstore.promote.view import View, first_view, look, owned
from tierstore.promote.views import TierViews
from tierstore.topology import current_node

logger, event = duties.logger, duties.event  # the promoter's log; the CLI's first and last lines


class Promoter:
    """Promotes, retains and cleans for one node (see the module docstring)."""

    def __init__(
        self, config: Config, *, node: int | None = None, metrics: PromoterMetrics | None = None
    ) -> None:
        ctx = self.context = duties.Context(config, current_node(node), metrics or PromoterMetrics())
        self.config, self.node, self.metrics, self.health = config, ctx.node, ctx.metrics, ctx.health
        self.tiers, self.by_name = list(ctx.tiers), ctx.by_name
        self.stopping, self.cancel = ctx.stopping, ctx.cancel
        self.views = TierViews(config.promote.full_scan)
        """Each tier's last listing, reused while its change stamp holds (promote/views.py)."""
        self.view = first_view(ctx)
        """The pass's view: the last look, as the duties since changed it."""
        self._confirm, self._sightings, self._report = ConfirmNumbers(), Sightings(), Report()
        self._backlog = 0
        self.unreachable, self.unavailable = ctx.availability.unreachable, ctx.availability.unavailable
        """The tiers the last look could not list, and why; those that refuse writes (as the last
        promotion into each found): the availability's own, kept up to date by it."""

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``addr:port`` from a daemon thread
        (port 0 picks a free one); return the port. Raises :class:`OSError` if it cannot bind."""
        return int(serve(self.metrics.registry, self.health, port, addr).server_port)

    def request_stop(self) -> None:
        """Stop starting work; abandon what is still in flight after the grace period."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        timer = threading.Timer(self.config.promote.grace_period, self.cancel.set)
        timer.daemon = True
        timer.start()

    def run(self, *, once: bool = False) -> int:
        """Loop until stopped (or one complete pass with ``once``); exit status for the CLI. The
        leases of the job-wide tiers it keeps are renewed meanwhile, and given up at the end."""
        stop_keeping = self.context.keepers.start() if not once else self.context.keepers.release
        try:
            while True:
                try:
                    report = self.run_once()
                    self._report.record_state(self.context, None, backlog=self._backlog, failed=report.failed)
                except (TierstoreError, OSError) as exc:  # an outage: keep the sidecar alive, retry
                    self.health.pass_failed(str(exc))
                    self._report.record_state(self.context, str(exc), backlog=self._backlog)
                    logger.error(
                        "promoter pass failed, retrying in %.0f s: %s", self.config.promote.interval, exc
                    )
                    if once:
                        return 1
                    report = duties.PassReport()
                done = [len(r) for r in (report.promoted, report.failed, report.deleted, report.cleaned)]
                away = ", ".join(self.unreachable) or "none"
                logger.debug(
                    "pass: %d promoted, %d failed, %d deleted, %d cleaned; unreachable: %s", *done, away
                )
                if once:  # a drain: anything left undone (a failed copy, a tier away) is an error
                    return 1 if report.failed or self.unreachable else 0
                if self.stopping.wait(self.config.promote.interval):
                    return 0
        finally:
            stop_keeping()

    def run_once(self) -> duties.PassReport:
        """Promote until nothing is left to do at this moment, then retention and (if due) gc."""
        report, ctx = duties.PassReport(), self.context
        attempted: set[Promotion] = set()
        self.health.beat()
        for round_ in range(len(self.tiers)):  # each round moves checkpoints one tier further
            self.look(refresh=round_ == 0)
            self.health.beat()
            due = promote.owed(self.view, ctx.rules)  # once per view: it walks every copy
            planned = [p for p in promote.plan(self.view, ctx.rules, due) if p not in attempted]
            self._backlog = promote.backlog(due, ctx)
            if not planned or self.stopping.is_set():
                break
            for promotion in planned:
                if self.stopping.is_set():
                    break
                attempted.add(promotion)
                self._take(promote.run(promotion, self.view, ctx), report)
        if attempted:  # else the last round's look is this one, its backlog told: nothing was done since
            self.look()
            self._backlog = promote.backlog(promote.owed(self.view, ctx.rules), ctx)
        self._take(conflicts.run(self.view, ctx))  # before retention: it keeps what they hold
        if not self.stopping.is_set():
            self._take(self._retain(self.view)[1], report)  # the sightings must not name what went
            every = min(self.config.promote.stale_after / 2, 600.0)
            self._take(collect.run(self.view, ctx, every=every), report)
        for duty in (self._sightings.run, self._report.run, mirrors.status):
            self._take(duty(self.view, ctx))
        self.metrics.last_pass.set_to_current_time()
        self.health.pass_finished()
        return report

    def look(self, *, refresh: bool = True, full: bool = False) -> View:
        """A new view of every tier (:func:`tierstore.promote.view.look`), after renewing or
        watching the job-wide tiers' leases (:mod:`tierstore.promote.keeper`); a refresh look is
        followed by the confirmation of this node's part numbers (:mod:`tierstore.promote.duties.confirm`)."""
        self.context.keepers.tick()
        self.view = look(self.context, self.views, self.view, refresh=refresh, full=full)
        if refresh:
            self._take(self._confirm.run(self.view, self.context))
        return self.view

    def _take(self, outcome: duties.Outcome, report: duties.PassReport | None = None) -> None:
        """What a duty tells the loop: the view from now on, the listings not to reuse, its report."""
        for name in outcome.forget:
            self.views.forget(name)
        self.view = outcome.view or self.view
        if report is not None:
            report.promoted += outcome.promoted
            report.failed += outcome.failed
            report.deleted += outcome.deleted
            report.cleaned += outcome.cleaned

    def _retain(self, view: View, *, dry_run: bool = False) -> tuple[View, duties.Outcome]:
        """Retention on ``view``, or on a ``full`` look made now if it decided on a reused listing
        (of a tier another node keeps, that look takes its keeper's index made under the stamp it
        reads, :func:`tierstore.promote.view.look`; the view it decided on is returned); then the
        mirrors'."""
        outcome = retain.run(view, self.context, dry_run=dry_run)
        if outcome.refresh:
            view = self.look(full=True)
            outcome = retain.run(view, self.context, dry_run=dry_run)
        if not dry_run:
            mirrors.prune(view, self.context)
        return view, outcome

    def catalog(self, *, refresh: bool = True, full: bool = False) -> dict[str, dict[str, SeenCopy]]:
        """What this node sees in every tier it can reach (committed copies; this node's parts): the
        copies of a new :meth:`look`, to edit at will."""
        return {name: dict(seen) for name, seen in self.look(refresh=refresh, full=full).found.items()}

    def apply_retention(
        self, found: dict[str, dict[str, SeenCopy]], *, dry_run: bool = False
    ) -> list[Deletion]:
        """Delete what retention no longer keeps on this node (``dry_run``: only say what), then
        prune the mirrors (:mod:`tierstore.promote.duties.retain`): when ``found`` reused an earlier
        listing and anything is to be deleted, every tier is listed again first and ``found`` is
        updated in place with that look."""
        view, outcome = self._retain(dataclasses.replace(self.view, found=found), dry_run=dry_run)
        if view.found is not found:  # every tier was listed again
            found.clear()
            found.update((name, dict(seen)) for name, seen in view.found.items())
        return list(outcome.deleted)

    def collect_garbage(self, *, dry_run: bool, stale_after: float | None = None) -> list[Cleanup]:
        """Remove (or with ``dry_run`` only list) uncommitted leftovers in the tiers this node looks
        after, left alone for ``stale_after`` (default: ``promote.stale_after``;
        :mod:`tierstore.promote.duties.collect`); the job-wide tiers' leases are looked at first
        (a tier another promoter keeps is its keeper's to clean)."""
        self.context.keepers.tick()
        view = dataclasses.replace(self.view, owned=owned(self.context))
        outcome = collect.run(view, self.context, dry_run=dry_run, stale_after=stale_after)
        return list(outcome.cleaned)
