"""The promoter sidecar: ``tierstore --config FILE promote``, one per training node.

Each pass: discover committed copies by their markers (polling, so it works on NFS/Lustre where other
nodes' writes raise no events; a tier whose change stamp is unchanged since the last listing is not
listed again, see :mod:`tierstore.promote.views`), plan promotions and retention with
:mod:`tierstore.promote.policy`, copy (see
:mod:`tierstore.promote.job`: verified data first, marker last), delete what retention no longer keeps
(marker first, then data), and now and then clean up uncommitted leftovers (:mod:`tierstore.promote.cleanup`).

It keeps working when the trainer crashes. ``--metrics-port`` serves ``/metrics`` and the probes
``/healthz`` (the loop still makes progress) and ``/readyz`` (a pass has finished): see
:mod:`tierstore.promote.health`. ``SIGTERM`` lets the files in flight finish within
``promote.grace_period``, then abandons them (no marker over partial data) and exits 0. Killed with
``kill -9``, a restart finishes or redoes the work; a rerun after success changes nothing.

Node-local tiers are handled by each node's promoter for its own part; moves between job-wide tiers
(shared, s3) and their retention are done by node 0's promoter only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tierstore._platform.bounded import Prober
from tierstore._platform.killpoints import kill_point
from tierstore.config import Config
from tierstore.errors import TierstoreError, TierUnavailableError
from tierstore.ids import intent_path
from tierstore.promote.cleanup import VOID_BELOW_TOP, Cleanup, find_leftovers, remove
from tierstore.promote.discovery import MarkerCache, SeenCopy, discover, foreign_parts
from tierstore.promote.endpoint import serve
from tierstore.promote.health import PromoterHealth, stall_bound
from tierstore.promote.job import PromotionJob
from tierstore.promote.metrics import PromoterMetrics
from tierstore.promote.policy import Copy, Deletion, Promotion, promotions, retention, superseded_parts
from tierstore.promote.retention import delete_copies
from tierstore.promote.rules import rules_of
from tierstore.promote.transfer import Cancelled
from tierstore.promote.views import TierView, TierViews
from tierstore.records.activity import live
from tierstore.records.changes import read_stamp
from tierstore.records.conflicts import Conflict, clear_conflict, read_conflicts, record_conflict
from tierstore.records.log import highest_in
from tierstore.records.marker import Manifest
from tierstore.records.mirror import read_status
from tierstore.records.mirror_retention import prune_mirrors
from tierstore.records.parts import PartRecord
from tierstore.records.promoter_state import PromoterState, write_state
from tierstore.records.protocol import Verdict, confirm_part, judge_promotion, restamp
from tierstore.records.sightings import Sighting, read_sightings, record_sighting
from tierstore.tiers import Tier
from tierstore.topology import current_node

logger = logging.getLogger(__name__)
COORDINATOR_NODE = 0
_KEPT = {
    Verdict.SAME: "the target already holds this commit",
    Verdict.KEEP_NEWER: "the target holds a newer commit of the id",
}
"""Why a promotion published nothing, by the protocol's verdict on the target's marker."""


def event(name: str, **fields: object) -> None:
    """One structured log line: ``name key=value ...`` (logfmt)."""
    logger.info(" ".join([name, *(f"{k}={_fmt(v)}" for k, v in fields.items())]))


def _fmt(value: object) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return f'"{text}"' if " " in text else text


@dataclass
class PassReport:
    """What one pass did."""

    promoted: list[Promotion] = field(default_factory=list)
    failed: list[tuple[Promotion, str]] = field(default_factory=list)
    deleted: list[Deletion] = field(default_factory=list)
    cleaned: list[Cleanup] = field(default_factory=list)


class Promoter:
    """Promotes, retains and cleans for one node (see the module docstring)."""

    def __init__(
        self, config: Config, *, node: int | None = None, metrics: PromoterMetrics | None = None
    ) -> None:
        self.config = config
        self.node = current_node(node)
        self.metrics = metrics or PromoterMetrics()
        self.rules = rules_of(config)
        self.health = PromoterHealth(stall_bound(config.promote.interval))
        self.metrics.watch(
            self.health, config.metrics.directory_for(self.node), stale_after=config.metrics.stale_after
        )
        self.tiers = config.make_tiers(node=self.node)
        self.by_name = {t.name: t for t in self.tiers}
        self.stopping = threading.Event()
        self.cancel = threading.Event()
        self.cache = MarkerCache()
        self.views = TierViews(config.promote.full_scan)
        """Each tier's last listing, reused while its change stamp holds (promote/views.py)."""
        self._reused: set[str] = set()
        """Tiers whose listing the last :meth:`catalog` reused rather than made."""
        self._parts: dict[str, dict[str, dict[str, list[PartRecord]]]] = {}
        """This node's parts of saves coordinated elsewhere, per node-local tier, as last listed."""
        self._unstamped = {tier.name for tier in self.tiers}
        """Tiers this process has not stamped yet at the end of a pass (:meth:`_stamp_once`)."""
        self.prober = Prober(config.probe_timeout)
        self._last_gc = 0.0
        self.unavailable: set[str] = set()
        """Tiers whose last promotion failed because they refuse writes (retried every pass)."""
        self.unreachable: dict[str, str] = {}
        """Tiers the last pass could not list (within ``probe_timeout``), and why."""
        self.highest: dict[str, int] = {}
        """The highest commit number logged in each tier, as last listed."""
        self._sighted: dict[tuple[str, str], Sighting] = {}
        """``(tier, tier seen)`` -> the sighting last left there (rewritten only when it changes)."""
        self._final: dict[tuple[str, str], int | None] = {}
        """The commit number of multi-node saves, from their committed manifest in a job-wide tier."""
        self._unknown: set[tuple[str, str]] = set()
        """Generations whose committed manifest was not there this pass (asked again next pass)."""
        self._newest_starts: dict[str, float] = {}
        """When the newest checkpoint seen in each tier was started (kept while a tier is away)."""
        self._conflicts: dict[str, list[Conflict]] = {}
        """Each tier's conflict records, as the pass's first listing read them."""
        self._started_at = time.time()
        self._passes = 0
        self._backlog = 0
        for tier in self.tiers:
            tier.observe_retries(self._count_retry(tier.name))

    def _count_retry(self, tier_name: str) -> Callable[[BaseException], None]:
        def count(_error: BaseException) -> None:
            self.metrics.retries.labels(tier_name).inc()

        return count

    # -- lifecycle ------------------------------------------------------------------------------

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
        """Loop until stopped (or one complete pass with ``once``); exit status for the CLI."""
        while True:
            try:
                report = self.run_once()
                self._record_state(None, report.failed)
            except (TierstoreError, OSError) as exc:  # an outage: keep the sidecar alive, retry
                self.health.pass_failed(str(exc))
                self._record_state(str(exc))
                logger.error(
                    "promoter pass failed, retrying in %.0f s: %s", self.config.promote.interval, exc
                )
                if once:
                    return 1
                report = PassReport()
            logger.debug(
                "pass: %d promoted, %d failed, %d deleted, %d cleaned; unreachable: %s",
                len(report.promoted),
                len(report.failed),
                len(report.deleted),
                len(report.cleaned),
                ", ".join(self.unreachable) or "none",
            )
            if once:  # a drain: anything left undone (a failed copy, a tier away) is an error
                return 1 if report.failed or self.unreachable else 0
            if self.stopping.wait(self.config.promote.interval):
                return 0

    # -- one pass -------------------------------------------------------------------------------

    def catalog(self, *, refresh: bool = True, full: bool = False) -> dict[str, dict[str, SeenCopy]]:
        """What this node sees in every tier it can reach (committed copies; this node's parts).

        Each tier's change stamp is read first; while it holds the token read before this
        promoter's previous listing of the tier, and that listing is younger than
        ``promote.full_scan``, the listing is reused (:mod:`tierstore.promote.views`); ``full``
        lists every tier regardless. Each tier is asked within
        ``probe_timeout``. A tier that cannot be listed is left out of the answer and recorded as
        unreachable (metric, log): nothing is promoted into or out of it, retention deletes
        nothing there, and the other tiers go on (tiers stand alone). ``refresh=False`` (the
        promotion rounds inside a pass) reuses the conflict records and the highest commit
        numbers read at the pass's start where a tier has changed: fewer requests to slow tiers
        (that listing is not kept).
        """
        found: dict[str, dict[str, SeenCopy]] = {}
        self._reused = set()
        for tier in self.tiers:

            def listing(tier: Tier = tier) -> tuple[TierView, bool]:
                started = time.monotonic()
                token = read_stamp(tier)  # before anything it covers is listed: records/changes.py
                view = None if full else self.views.reusable(tier.name, token)
                if view is not None:
                    return view, True
                known = None if refresh else self._conflicts.get(tier.name)
                conflicts = read_conflicts(tier) if known is None else known
                highest = highest_in(tier) if refresh else self.highest.get(tier.name, 0)
                seen = discover(tier, self.cache, conflicts)
                parts = foreign_parts(tier, self.cache) if tier.node_local else {}
                return TierView(token, started, seen, highest, tuple(conflicts), parts), False

            try:
                view, reused = self.prober.ask(tier.name, listing, what="list its checkpoints")
            except (TierstoreError, OSError) as exc:
                self.views.forget(tier.name)
                self._set_unreachable(tier.name, f"cannot list tier {tier.describe()}: {exc}")
                continue
            if reused:
                self._reused.add(tier.name)
            elif refresh:
                self.views.keep(tier.name, view)
            else:  # made with the pass's first log and conflict records: not a listing to keep
                self.views.forget(tier.name)
            found[tier.name] = dict(view.found)  # a pass edits its copy (conflicts, deletions)
            self.highest[tier.name] = view.highest
            self._conflicts[tier.name] = list(view.conflicts)
            self._parts[tier.name] = view.parts
            self._set_unreachable(tier.name, None)
        if refresh:
            self._unknown.clear()  # committed manifests not there before may be there now
            self._confirm_numbers(found)
        return found

    def _confirm_numbers(self, found: dict[str, dict[str, SeenCopy]]) -> None:
        """This node's parts of multi-node saves carry the commit number claimed when the save was
        planned; the coordinator may have taken a higher one at its commit (a save that committed
        meanwhile). Once the final number is in a job-wide tier (the id's marker there, or the
        committed manifest the coordinator's node left, ``parts/manifest.json``), the part records
        are rewritten with it (``confirmed``) and the tier is looked at again: this node's part
        then ranks, and is promoted, by it, like the coordinator's."""
        wide = [t for t in self.tiers if not t.node_local and t.name in found]
        for tier in self.tiers:
            if not tier.node_local or tier.name not in found:
                continue
            try:
                changed = False
                for generations in self._parts.get(tier.name, {}).values():
                    for records in generations.values():
                        changed |= self._confirm(tier, wide, found, records)
                if changed:  # their records were rewritten (and the tier stamped): list it again
                    self.views.forget(tier.name)
                    found[tier.name] = discover(tier, self.cache, self._conflicts.get(tier.name))
                    self._parts[tier.name] = foreign_parts(tier, self.cache)
            except (TierstoreError, OSError) as exc:
                logger.warning("cannot confirm the commit numbers of the parts in %s: %s", tier.name, exc)

    def _confirm(
        self, tier: Tier, wide: list[Tier], found: dict[str, dict[str, SeenCopy]], records: list[PartRecord]
    ) -> bool:
        """Rewrite a part's records with its final number once known; True if it did."""
        first = records[0]
        if all(r.confirmed for r in records):
            return False
        final = self._final_number(wide, found, first.checkpoint_id, first.generation)
        return final is not None and confirm_part(tier, first.checkpoint_id, first.generation, final)

    def _final_number(
        self, wide: list[Tier], found: dict[str, dict[str, SeenCopy]], checkpoint_id: str, generation: str
    ) -> int | None:
        """The generation's number as committed: from a job-wide tier's marker of it, else its
        committed manifest there (each asked within ``probe_timeout``); None while unknown."""
        key = (checkpoint_id, generation)
        for tier in wide:
            there = found[tier.name].get(checkpoint_id)
            if there is not None and not there.copy.partial and there.copy.generation == generation:
                return there.copy.seq
        if key in self._final or key in self._unknown:
            return self._final.get(key)
        self._unknown.add(key)
        path = intent_path(checkpoint_id, generation)
        for tier in wide:
            try:
                blob = self.prober.ask(
                    tier.name, functools.partial(tier.read_bytes, path), what=f"read {path}"
                )
                self._final[key] = Manifest.from_json(blob, where=f"tier {tier.name}: {path}").seq
                return self._final[key]
            except FileNotFoundError:
                continue
            except (TierstoreError, OSError) as exc:
                logger.warning("cannot read %s in %s: %s", path, tier.name, exc)
        return None

    def _set_unreachable(self, tier_name: str, error: str | None) -> None:
        was = tier_name in self.unreachable
        if error is not None:
            self.unreachable[tier_name] = error
            if not was:
                event("tier_unreachable", tier=tier_name, error=error.replace("\n", "; "))
                logger.error("tier %s is unreachable; the other tiers go on without it: %s", tier_name, error)
        elif was:
            del self.unreachable[tier_name]
            event("tier_reachable", tier=tier_name)
        self._export_availability(tier_name)

    def _export_availability(self, tier_name: str) -> None:
        away = tier_name in self.unavailable or tier_name in self.unreachable
        self.metrics.unavailable.labels(tier_name).set(1 if away else 0)

    def _away(self) -> frozenset[str]:
        """Tiers refusing writes or unreachable this pass."""
        return frozenset(self.unavailable | set(self.unreachable))

    def run_once(self) -> PassReport:
        """Promote until nothing is left to do at this moment, then retention and (if due) gc."""
        report = PassReport()
        attempted: set[Promotion] = set()
        self.health.beat()
        found: dict[str, dict[str, SeenCopy]] = {}
        for _round in range(len(self.tiers)):  # each round moves checkpoints one tier further
            found = self.catalog(refresh=_round == 0)
            self.health.beat()
            planned = [p for p in self._plan(found) if p not in attempted]
            self._set_backlog(planned)
            if not planned or self.stopping.is_set():
                break
            for promotion in planned:
                if self.stopping.is_set():
                    break
                attempted.add(promotion)
                self._promote(promotion, found[promotion.source][promotion.checkpoint_id], report)
        if attempted:  # else the first round's look is this one: nothing was done since
            found = self.catalog()
        self._set_backlog(self._plan(found))
        self._detect_conflicts(found)
        self._settle_conflicts(found)
        if not self.stopping.is_set():
            report.deleted = self.apply_retention(found)
            for deletion in report.deleted:  # the sightings must not name what is gone
                found.get(deletion.tier, {}).pop(deletion.checkpoint_id, None)
            if time.time() - self._last_gc >= min(self.config.promote.stale_after / 2, 600.0):
                report.cleaned = self.collect_garbage(dry_run=False)
                self._last_gc = time.time()
        self._stamp_once(found)
        self._record_sightings(found)
        self._update_durable_age(found)
        self._update_mirror_status(found)
        self.metrics.last_pass.set_to_current_time()
        self.health.pass_finished()
        return report

    def _stamp_once(self, found: dict[str, dict[str, SeenCopy]]) -> None:
        """Stamp each tier once per promoter process, at the end of the first pass that lists it
        (within ``probe_timeout``): a predecessor killed between a change and its stamp left that
        change unstamped, and every promoter sees it at its next pass (records/changes.py). After
        the pass's own look, so that a restart's first look is not slowed by it."""
        for tier in self.tiers:
            if tier.name not in self._unstamped or tier.name not in found:
                continue
            try:
                self.prober.ask(tier.name, functools.partial(restamp, tier), what="stamp it")
            except (TierstoreError, OSError) as exc:
                logger.warning("cannot stamp tier %s: %s", tier.name, exc)
                continue
            self._unstamped.discard(tier.name)

    def _copies(self, found: dict[str, dict[str, SeenCopy]]) -> dict[str, dict[str, Copy]]:
        return {name: {i: s.copy for i, s in seen.items()} for name, seen in found.items()}

    def _plan(self, found: dict[str, dict[str, SeenCopy]]) -> list[Promotion]:
        planned = promotions(self.rules, self._copies(found), self._away())
        mine = []
        for promotion in planned:
            if promotion.source in self.unreachable or promotion.target in self.unreachable:
                continue  # retried once the tier answers again
            source = self.by_name[promotion.source]
            if source.node_local or self.node == COORDINATOR_NODE:
                mine.append(promotion)
        return mine

    def _set_unavailable(self, tier_name: str, error: str | None) -> None:
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
        self._export_availability(tier_name)

    def _record_state(self, error: str | None, failed: list[tuple[Promotion, str]] | None = None) -> None:
        """Leave how this pass ended where ``tierstore status`` reads it: the node-local tiers this
        promoter looks after, or its first tier when it has none (records/promoter_state.py)."""
        if error is None:
            self._passes += 1
        state = PromoterState(
            node=self.node,
            interval=self.config.promote.interval,
            stall_after=self.health.stall_after,
            passes=self._passes,
            last_error=None if error is None else error.replace("\n", "; "),
            unreachable=dict(self.unreachable),
            unavailable=tuple(sorted(self.unavailable)),
            backlog=self._backlog,
            started_at=self._started_at,
            failed=tuple(
                f"{p.checkpoint_id} {p.source}->{p.target}: {why}".replace("\n", "; ")
                for p, why in failed or ()
            ),
        )
        for tier in [t for t in self.tiers if t.node_local] or self.tiers[:1]:
            if tier.name in self.unreachable:
                continue
            try:
                write_state(tier, state)
            except (TierstoreError, OSError) as exc:  # advisory: never stops the promoter
                logger.warning("cannot record the promoter's state in tier %s: %s", tier.name, exc)

    def _set_backlog(self, planned: list[Promotion]) -> None:
        self._backlog = len(planned)
        for tier in self.tiers[1:]:
            self.metrics.backlog.labels(tier.name).set(sum(p.target == tier.name for p in planned))

    def _promote(self, promotion: Promotion, found: SeenCopy, report: PassReport) -> None:
        source, target = self.by_name[promotion.source], self.by_name[promotion.target]
        logger.debug(
            "promoting %s (generation %s) from %s to %s",
            promotion.checkpoint_id,
            found.copy.generation,
            source.name,
            target.name,
        )
        job = PromotionJob(
            source,
            target,
            found,
            node=self.node,
            durable=target is self.tiers[-1],
            workers=self.config.promote.workers,
            stopping=self.stopping,
            cancel=self.cancel,
            activity_ttl=self.config.promote.activity_ttl,
            heartbeat=self.health.beat,
        )
        started = time.monotonic()
        try:
            outcome = job.run()
        except Cancelled:
            event("promotion_abandoned", checkpoint=promotion.checkpoint_id, target=target.name)
            return
        except (TierstoreError, OSError) as exc:
            self.metrics.failures.labels(target.name).inc()
            report.failed.append((promotion, str(exc)))
            for tier_name in (source.name, target.name):  # the source may have lost the copy
                self.views.forget(tier_name)  # behind tierstore's back: both listed again
            if isinstance(exc, TierUnavailableError) and exc.tier == target.name:
                self._set_unavailable(target.name, str(exc))
            event(
                "promotion_failed",
                checkpoint=promotion.checkpoint_id,
                source=source.name,
                target=target.name,
                error=str(exc).replace("\n", "; "),
            )
            logger.error("promotion of %s to %s failed: %s", promotion.checkpoint_id, target.name, exc)
            return
        kill_point("promote.committed", promotion.checkpoint_id)
        seconds = time.monotonic() - started
        self._set_unavailable(target.name, None)
        if outcome.verdict is Verdict.CONFLICT and outcome.existing is not None:
            self._report_conflict(source, target, found, outcome.existing)
            return
        self.metrics.bytes_promoted.labels(target.name).inc(outcome.copied)
        if outcome.committed:
            self.metrics.checkpoints_promoted.labels(target.name).inc()
            self.metrics.promotion_seconds.labels(target.name).observe(seconds)
            report.promoted.append(promotion)
        if outcome.verdict in (Verdict.SAME, Verdict.KEEP_NEWER):  # nothing of ours was published
            event(
                "promotion_skipped",
                checkpoint=promotion.checkpoint_id,
                source=source.name,
                target=target.name,
                reason=_KEPT[outcome.verdict],
            )
            return
        # Every byte copied was checked against the marker's CRC32C on the way (transfer.py).
        event(
            "promoted" if outcome.committed else "part_copied",
            checkpoint=promotion.checkpoint_id,
            source=source.name,
            target=target.name,
            node=self.node,
            bytes=outcome.copied,
            seconds=seconds,
            verified="crc32c",
        )

    def _report_conflict(self, source: Tier, target: Tier, found: SeenCopy, existing: Manifest) -> None:
        """Keep both contents of the id: a record in the source tier (retention keeps the copy,
        promotion stops retrying it), an error line, the metric."""
        manifest = found.manifest
        assert manifest is not None
        _verdict, why = judge_promotion(manifest, existing, source_tier=source.name, target=target.name)
        conflict = Conflict(
            manifest.checkpoint_id,
            manifest.generation,
            manifest.seq,
            target.name,
            existing.generation,
            existing.seq,
            why,
        )
        try:
            new = record_conflict(source, conflict)
        except (TierstoreError, OSError) as exc:
            logger.error("could not record the conflict of %s: %s", conflict.describe(), exc)
            return
        if new:
            self._conflicts.setdefault(source.name, []).append(conflict)
            event(
                "conflict",
                checkpoint=conflict.checkpoint_id,
                tier=source.name,
                target=target.name,
                generation=conflict.generation,
                target_generation=conflict.target_generation,
            )
            logger.error(
                "not promoted, both kept: %s. Keep one: `tierstore drop %s --tier NAME` on the"
                " other, or save it again with overwrite=True",
                conflict.describe(),
                conflict.checkpoint_id,
            )

    def _detect_conflicts(self, found: dict[str, dict[str, SeenCopy]]) -> None:
        """Every id held by a tier and a tier below at different generations, whose saves did not
        know of each other (:func:`~tierstore.records.protocol.judge_promotion`), gets a conflict
        record in the upper tier, whether or not it would be promoted there: neither content is
        dropped silently (commit numbers taken without that knowledge may even be equal)."""
        names = [t.name for t in self.tiers]
        for upper_index, upper in enumerate(self.tiers):
            if upper.name not in found or not self._owns(upper):
                continue
            for lower_name in names[upper_index + 1 :]:
                for checkpoint_id, seen in found[upper.name].items():
                    there = found.get(lower_name, {}).get(checkpoint_id)
                    if (
                        there is None
                        or seen.manifest is None
                        or there.manifest is None
                        or there.copy.generation == seen.copy.generation
                        or lower_name in seen.copy.conflicts
                    ):
                        continue
                    verdict, _why = judge_promotion(
                        seen.manifest, there.manifest, source_tier=upper.name, target=lower_name
                    )
                    if verdict is Verdict.CONFLICT:
                        self._report_conflict(upper, self.by_name[lower_name], seen, there.manifest)
                        # retention in this very pass must keep it too
                        copy = dataclasses.replace(seen.copy, conflicts=seen.copy.conflicts | {lower_name})
                        found[upper.name][checkpoint_id] = dataclasses.replace(seen, copy=copy)

    def _settle_conflicts(self, found: dict[str, dict[str, SeenCopy]]) -> None:
        """Drop conflict records that no longer hold (either content is gone or was replaced):
        promotion of the copy, if it still belongs below, resumes at the next pass."""
        for tier in self.tiers:
            if tier.name not in found or not self._owns(tier):
                continue
            conflicts = self._conflicts.setdefault(tier.name, [])
            try:
                for conflict in list(conflicts):
                    here = found[tier.name].get(conflict.checkpoint_id)
                    there = found.get(conflict.target, {}).get(conflict.checkpoint_id)
                    settled = here is None or here.copy.generation != conflict.generation
                    if conflict.target in found:  # a target that cannot be listed settles nothing
                        settled = settled or there is None
                        settled = settled or (
                            there is not None and there.copy.generation != conflict.target_generation
                        )
                    if settled:
                        clear_conflict(tier, conflict)
                        conflicts.remove(conflict)
                        event(
                            "conflict_settled",
                            checkpoint=conflict.checkpoint_id,
                            tier=tier.name,
                            target=conflict.target,
                        )
            except (TierstoreError, OSError) as exc:
                logger.warning("cannot settle the conflict records of %s: %s", tier.name, exc)
            self.metrics.conflicts.labels(tier.name).set(len(conflicts))

    def _record_sightings(self, found: dict[str, dict[str, SeenCopy]]) -> None:
        """Leave in every tier this node looks after what it saw in each other tier it could list
        (:mod:`tierstore.records.sightings`): saves and restores there then ask no other tier."""
        for tier in self.tiers:
            if tier.name not in found or not self._owns(tier):
                continue
            for seen_name, seen in found.items():
                if seen_name == tier.name:
                    continue
                ids = {i: (s.copy.seq, s.copy.generation) for i, s in seen.items() if s.manifest is not None}
                highest = max([self.highest.get(seen_name, 0), *(seq or 0 for seq, _gen in ids.values())])
                sighting = Sighting(seen_name, highest, ids)
                key = (tier.name, seen_name)
                try:
                    if key not in self._sighted:
                        self._sighted.update(
                            ((tier.name, name), known) for name, known in read_sightings(tier).items()
                        )
                    known = self._sighted.get(key)
                    if record_sighting(tier, sighting, known, refresh_after=self.config.promote.interval):
                        self._sighted[key] = sighting
                except (TierstoreError, OSError) as exc:
                    logger.warning("cannot record what %s holds in %s: %s", seen_name, tier.name, exc)

    # -- retention and gc -----------------------------------------------------------------------

    def planned_deletions(self, found: dict[str, dict[str, SeenCopy]]) -> list[Deletion]:
        """What retention would delete now on this node (work in progress and node ownership
        respected: an id named by a live activity record is in use)."""
        in_use: set[str] = set()
        for tier in self.tiers:
            if tier.name in self.unreachable or tier.name not in found:
                continue  # nothing is deleted there this pass; its records guard only its copies
            try:
                ttl = self.config.promote.activity_ttl
                in_use |= {record.checkpoint_id for record in live(tier, ttl=ttl)}
            except (TierstoreError, OSError) as exc:
                logger.warning(
                    "cannot read activity records in %s (%s): no deletion this pass", tier.name, exc
                )
                return []
        held = self._copies(found)
        decided = retention(self.rules, held, frozenset(in_use), unavailable=self._away())
        decided += self._superseded_parts(found, held, in_use)
        return [d for d in decided if self._owns(self.by_name[d.tier]) and not _unconfirmed(found, d)]

    def _superseded_parts(
        self, found: dict[str, dict[str, SeenCopy]], held: dict[str, dict[str, Copy]], in_use: set[str]
    ) -> list[Deletion]:
        """This node's parts of replaced saves coordinated elsewhere (see
        :func:`~tierstore.promote.policy.superseded_parts`); ids at work are left alone."""
        decided: list[Deletion] = []
        for tier in self.tiers:
            if not tier.node_local or tier.name in self.unreachable or tier.name not in found:
                continue
            try:
                parts = {
                    checkpoint_id: {gen: self._settle_part(records) for gen, records in generations.items()}
                    for checkpoint_id, generations in self._parts.get(tier.name, {}).items()
                    if checkpoint_id not in in_use
                }
            except (TierstoreError, OSError) as exc:
                logger.warning("cannot judge the parts in %s (%s)", tier.name, exc)
                continue
            decided += superseded_parts(tier.name, parts, held)
        return decided

    @staticmethod
    def _settle_part(records: list[PartRecord]) -> tuple[int | None, bool]:
        """``(seq, settled)`` of this node's part of a save coordinated elsewhere: settled once its
        number is final (confirmed: :meth:`_confirm_numbers`, or by the coordinator at its next
        save). A planned number says nothing: the save may still commit under a higher one."""
        return records[0].seq, all(r.confirmed for r in records)

    def _owns(self, tier: Tier) -> bool:
        return tier.node_local or self.node == COORDINATOR_NODE

    def apply_retention(
        self, found: dict[str, dict[str, SeenCopy]], *, dry_run: bool = False
    ) -> list[Deletion]:
        """Delete what retention no longer keeps on this node (``dry_run``: only say what).

        Deletions are decided by listings made now: when ``found`` reused an earlier listing of
        some tier (:mod:`tierstore.promote.views`) and retention would delete anything, every tier
        is listed again first and ``found`` is updated in place with that look.
        """
        planned = self.planned_deletions(found)
        if planned and self._reused:
            fresh = self.catalog(full=True)
            found.clear()
            found.update(fresh)
            planned = self.planned_deletions(found)
        if dry_run:
            return planned

        def deleted(deletion: Deletion) -> None:
            self.metrics.deleted.labels(deletion.tier).inc()
            event("deleted", checkpoint=deletion.checkpoint_id, tier=deletion.tier, reason=deletion.reason)

        done = delete_copies(self.by_name, planned, on_deleted=deleted, ttl=self.config.promote.activity_ttl)
        self._prune_mirrors()
        return done

    def _prune_mirrors(self) -> None:
        """Retention of the peer mirrors this node holds (a node that stopped receiving mirrors,
        or whose partner left the job, keeps none beyond ``keep``)."""
        for tier in self.tiers:
            if tier.mirror is None:
                continue
            try:
                readers = [a for a in live(tier, ttl=self.config.promote.activity_ttl) if a.kind == "read"]
                for removed in prune_mirrors(
                    tier,
                    self.config.policy(tier.name).keep,
                    readers=readers,
                    ttl=self.config.promote.activity_ttl,
                ):
                    event("mirror_deleted", tier=tier.name, mirror=removed)
            except (TierstoreError, OSError) as exc:
                logger.warning("retention of the mirrors in %s failed: %s", tier.name, exc)

    def collect_garbage(self, *, dry_run: bool) -> list[Cleanup]:
        """Remove (or with ``dry_run`` only list) uncommitted leftovers in the tiers this node owns.

        Each tier is looked at afresh (see :func:`~tierstore.promote.cleanup.find_leftovers`): a
        catalog read earlier in the pass would not know of commits made since.
        """
        cleanups: list[Cleanup] = []
        for tier in self.tiers:
            if not self._owns(tier) or tier.name in self.unreachable:
                continue
            try:
                leftovers = find_leftovers(
                    tier,
                    stale_after=self.config.promote.stale_after,
                    activity_ttl=self.config.promote.activity_ttl,
                    warned=self.cache.foreign,
                )
            except (TierstoreError, OSError) as exc:
                logger.warning("gc of %s skipped: %s", tier.name, exc)
                continue
            for cleanup in leftovers:
                if not dry_run:
                    try:
                        remove(tier, cleanup, activity_ttl=self.config.promote.activity_ttl)
                    except (TierstoreError, OSError) as exc:
                        logger.warning("gc of %s in %s failed: %s", cleanup.path, tier.name, exc)
                        continue
                    if cleanup.reason == VOID_BELOW_TOP:  # bookkeeping of the log, every commit
                        logger.debug("cleaned %s in %s: %s", cleanup.path, tier.name, cleanup.reason)
                    else:
                        event("cleaned", tier=tier.name, path=cleanup.path, reason=cleanup.reason)
                    kill_point("cleanup.between_removals", cleanup.path)
                cleanups.append(cleanup)
        return cleanups

    def _update_mirror_status(self, found: dict[str, dict[str, SeenCopy]]) -> None:
        """Whether this node's part of the newest checkpoint of each mirrored tier has a mirror
        (the save's own record: :mod:`tierstore.records.mirror`)."""
        for tier in self.tiers:
            seen = [s.copy for s in found.get(tier.name, {}).values()]
            if tier.mirror is None or not seen:
                continue
            newest = max(seen, key=lambda c: (c.seq or 0, c.generation))
            try:
                status = read_status(tier, newest.checkpoint_id, newest.generation, self.node)
            except (TierstoreError, OSError) as exc:
                logger.warning("cannot read the mirror status of %s: %s", newest.checkpoint_id, exc)
                continue
            if status is not None:
                self.metrics.mirrored.labels(tier.name).set(1 if status.mirrored else 0)

    def _update_durable_age(self, found: dict[str, dict[str, SeenCopy]]) -> None:
        """How old the newest checkpoint of each tier is, and of the durable (last) one above all:
        the recovery-point lag. While a tier cannot be listed, the last one seen there is still the
        newest known, and its age grows."""
        now = time.time()
        for tier in self.tiers:
            starts = [
                float(s.manifest.timings.get("started_at") or s.copy.committed_at)
                for s in found.get(tier.name, {}).values()
                if s.manifest is not None
            ]
            if starts:
                self._newest_starts[tier.name] = max(starts)
            if tier.name in self._newest_starts:
                age = max(0.0, now - self._newest_starts[tier.name])
                self.metrics.newest_age.labels(tier.name).set(age)
        if self.tiers[-1].name in self._newest_starts:
            lag = max(0.0, now - self._newest_starts[self.tiers[-1].name])
            self.metrics.durable_age.set(lag)
            self.metrics.recovery_point_lag.set(lag)


def _unconfirmed(found: dict[str, dict[str, SeenCopy]], deletion: Deletion) -> bool:
    """True when ``deletion`` is of this node's part of a save coordinated elsewhere whose number is
    still the planned one: retention ranks by commit order, and that save may have committed after
    the ones it is ranked below. It waits until its number is confirmed."""
    seen = found.get(deletion.tier, {}).get(deletion.checkpoint_id)
    if seen is None or not seen.copy.partial or seen.copy.generation != deletion.generation:
        return False
    return not all(record.confirmed for record in seen.parts)
