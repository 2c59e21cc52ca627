"""``tierstore status``: how each tier, each node's mirror and each node's promoter stand, in one look.

What each row and problem means: docs/operations.md, "Status at a glance". A run counts as ended (see
:func:`idle_bound`) once nothing was committed for three times its usual gap between saves, and for at
least ten promoter intervals. Nothing here writes (the CLI loads the configuration without creating
tier directories for it); every question to a tier is bounded by ``probe_timeout``, so a hung tier is
reported, never waited for.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tierstore._platform.bounded import Prober
from tierstore.config import Config
from tierstore.errors import TierstoreError
from tierstore.records.catalog import Catalog, Listing
from tierstore.records.marker import read_manifest
from tierstore.records.mirror import MirrorStatus, read_status
from tierstore.records.promoter_state import PromoterState, read_state
from tierstore.signing import MarkerTrust
from tierstore.tiers import Space, Tier, is_host_memory
from tierstore.units import human_age, human_bytes


@dataclass(frozen=True)
class Newest:
    """A tier's newest committed checkpoint."""

    checkpoint_id: str
    step: int | None
    committed_at: float
    started_at: float
    """When its save began: its data is this old."""


@dataclass(frozen=True)
class TierStatus:
    """One tier as seen from one node (job-wide tiers: ``node`` is None)."""

    name: str
    type: str
    node: int | None
    durable: bool
    """The last tier: the one the recovery point is measured in."""
    error: str | None = None
    """Why the tier could not be listed within ``probe_timeout``; None when it answered."""
    checkpoints: int = 0
    bytes: int = 0
    keep: int | None = None
    """Its retention (``keep``): how many checkpoints it holds at most."""
    space: Space | None = None
    newest: Newest | None = None
    lag_s: float | None = None
    """Seconds since the newest checkpoint here began to be saved."""

    @property
    def reachable(self) -> bool:
        """True when the tier answered."""
        return self.error is None


@dataclass(frozen=True)
class MirrorState:
    """Whether a node's part of a mirrored tier's newest checkpoint is held by a partner node."""

    tier: str
    node: int
    checkpoint_id: str
    mirrored: bool | None
    """None: no record yet (a save still exchanging, or a tier that cannot say)."""
    holder_node: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class PromoterView:
    """One node's promoter, judged from its last record."""

    node: int
    ok: bool
    why: str
    state: PromoterState | None = None


@dataclass
class StatusReport:
    """Everything ``tierstore status`` shows (see the module docstring)."""

    tiers: list[TierStatus] = field(default_factory=list)
    mirrors: list[MirrorState] = field(default_factory=list)
    promoters: list[PromoterView] = field(default_factory=list)
    newest: Newest | None = None
    """The newest committed checkpoint in any tier listed."""
    durable: Newest | None = None
    """The newest checkpoint in the last (durable) tier."""
    at: float = field(default_factory=time.time)
    max_lag: float | None = None
    """A recovery point older than this many seconds is a problem (``--max-lag``)."""
    idle_bound: float | None = None
    """Seconds without a commit after which the run looks ended (:func:`idle_bound`); None: no rule."""

    @property
    def durable_reachable(self) -> bool:
        """False when the durable tier did not answer: the recovery point is then unknown."""
        return all(t.reachable for t in self.tiers if t.durable)

    @property
    def recovery_point_lag_s(self) -> float | None:
        """Seconds of training a restore from the durable tier would redo (None: nothing durable)."""
        return None if self.durable is None else max(0.0, self.at - self.durable.started_at)

    def problems(self) -> list[str]:
        """One line per thing an operator should look at: unreachable tiers, no durable copy,
        mirrors not held, promoters stuck, failing or never seen."""
        found = []
        for tier in self.tiers:
            if tier.error is not None:
                found.append(f"tier {_where(tier)} is unreachable: {tier.error}")
        if (
            self.newest is not None
            and self.durable is None
            and any(t.durable and t.reachable for t in self.tiers)
        ):
            found.append("no checkpoint is in the durable tier yet")
        if (stranded := self._stranded()) is not None:
            found.append(stranded)
        lag = self.recovery_point_lag_s
        if self.max_lag is not None and lag is not None and lag > self.max_lag:
            found.append(
                f"the recovery point is {human_age(lag)} old, older than --max-lag {human_age(self.max_lag)}"
            )
        for mirror in self.mirrors:
            if mirror.mirrored is False:
                found.append(
                    f"tier {mirror.tier} node {mirror.node}: {mirror.checkpoint_id} has no peer"
                    f" mirror (reduced redundancy){': ' + mirror.reason if mirror.reason else ''}"
                )
        for promoter in self.promoters:
            if not promoter.ok:
                found.append(f"promoter of node {promoter.node}: {promoter.why}")
            if promoter.state is not None:
                found += [f"promoter of node {promoter.node}: {p}" for p in promoter.state.troubles()]
        return found

    def _stranded(self) -> str | None:
        """The problem of a newest checkpoint not in the durable tier once the run looks ended."""
        newest, durable, bound = self.newest, self.durable, self.idle_bound
        if newest is None or durable is None or bound is None or not self.durable_reachable:
            return None
        idle = self.at - newest.committed_at
        if newest.checkpoint_id == durable.checkpoint_id or idle <= bound:
            return None
        last = ", ".join(sorted({t.name for t in self.tiers if t.durable}))
        return (
            f"the newest checkpoint {newest.checkpoint_id} is not in the durable tier {last}, and"
            f" nothing was committed for {human_age(idle)} (the run looks ended after"
            f" {human_age(bound)}): its last state is not durable. promote.every copies only every"
            " k-th commit there; end runs with CheckpointManager.close(), which saves the last"
            " state into it"
        )

    @property
    def ok(self) -> bool:
        """True when :meth:`problems` finds nothing."""
        return not self.problems()

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "at": self.at,
            "ok": self.ok,
            "problems": self.problems(),
            "newest": None if self.newest is None else asdict(self.newest),
            "durable": None if self.durable is None else asdict(self.durable),
            "recovery_point_lag_s": self.recovery_point_lag_s,
            "idle_bound_s": self.idle_bound,
            "durable_reachable": self.durable_reachable,
            "tiers": [
                {**asdict(t), "reachable": t.reachable, "space": _space_dict(t.space)} for t in self.tiers
            ],
            "mirrors": [asdict(m) for m in self.mirrors],
            "promoters": [
                {
                    "node": p.node,
                    "ok": p.ok,
                    "why": p.why,
                    "state": None if p.state is None else asdict(p.state),
                }
                for p in self.promoters
            ],
        }


def gather_status(
    config: Config, nodes: Sequence[int], *, now: float | None = None, max_lag: float | None = None
) -> StatusReport:
    """The status of every tier of ``config`` as seen from ``nodes`` (the first lists the job-wide
    tiers too), their mirrors and their promoters; ``max_lag``: seconds past which the recovery
    point is a problem."""
    report = StatusReport(at=time.time() if now is None else now, max_lag=max_lag)
    last = config.tiers[-1].name
    prober = Prober(config.probe_timeout)
    commits: dict[str, float] = {}
    for index, node in enumerate(nodes):
        tiers = config.make_tiers(node=node)
        shown = tiers if index == 0 else [t for t in tiers if t.node_local]
        if not shown:
            continue
        catalog = Catalog(config, node=node, tiers=shown)
        try:
            listings = catalog.listings()
        except TierstoreError:  # nothing could be listed: every tier is in catalog.unreachable
            listings = []
        commits.update((entry.checkpoint_id, entry.committed_at) for entry in listings)
        keeps = {c.name: config.policy(c.name).keep for c in config.tiers}
        for tier in shown:
            status = _tier_status(
                tier,
                node,
                listings,
                error=catalog.unreachable.get(tier.name),
                keep=keeps[tier.name],
                durable=tier.name == last,
                prober=prober,
                now=report.at,
            )
            report.tiers.append(status)
            if status.reachable and status.newest is not None and tier.name == config.mirrored:
                state = _mirror_state(tier, node, status.newest.checkpoint_id, prober, catalog.trust)
                report.mirrors.append(state)
        away = {t.name for t in report.tiers if not t.reachable}
        report.promoters.append(_promoter_view(tiers, node, report.at, prober, away))
    report.newest = _newest([t.newest for t in report.tiers])
    report.durable = _newest([t.newest for t in report.tiers if t.durable])
    report.idle_bound = idle_bound(list(commits.values()), float(config.promote.interval))
    return report


IDLE_GAPS = 3
"""A run looks ended after this many of its usual gaps between saves without a commit."""
IDLE_INTERVALS = 10
"""... and after at least this many promoter intervals (the promoter's own liveness bound)."""
GAPS_MEASURED = 10
"""The usual gap is the median over the newest this many commits."""


def idle_bound(committed_at: Sequence[float], interval: float) -> float:
    """Seconds without a new commit after which a run looks ended: :data:`IDLE_GAPS` times the
    median gap between its newest :data:`GAPS_MEASURED` commits, and at least
    :data:`IDLE_INTERVALS` promoter intervals (``interval``). Retention thinning the older commits
    only widens the gaps: the rule then waits longer, never shorter."""
    newest = sorted(committed_at, reverse=True)[:GAPS_MEASURED]
    gaps = [a - b for a, b in itertools.pairwise(newest)]
    usual = statistics.median(gaps) if gaps else 0.0
    return max(IDLE_GAPS * usual, IDLE_INTERVALS * interval)


def _tier_status(
    tier: Tier,
    node: int,
    listings: list[Listing],
    *,
    error: str | None,
    keep: int | None,
    durable: bool,
    prober: Prober,
    now: float,
) -> TierStatus:
    where = node if tier.node_local else None
    if error is not None:
        return TierStatus(tier.name, tier.type, where, durable, error=error, keep=keep)
    held = [entry for entry in listings if tier.name in entry.tiers]
    newest = None
    if held:
        first = held[0]
        started = first.timings.get("started_at")
        newest = Newest(
            first.checkpoint_id,
            first.step,
            first.committed_at,
            float(started) if started is not None else first.committed_at,
        )
    try:
        space = None
        if (local := tier.local) is not None:
            space = prober.ask(tier, local.space, what="measure its space", direct=local.staging)
    except (TierstoreError, OSError) as exc:
        return TierStatus(tier.name, tier.type, where, durable, error=str(exc), keep=keep)
    return TierStatus(
        tier.name,
        tier.type,
        where,
        durable,
        checkpoints=len(held),
        bytes=sum(e.bytes for e in held),
        keep=keep,
        space=space,
        newest=newest,
        lag_s=None if newest is None else max(0.0, now - newest.started_at),
    )


def _mirror_state(
    tier: Tier, node: int, checkpoint_id: str, prober: Prober, trust: MarkerTrust
) -> MirrorState:
    def question() -> MirrorStatus | None:
        generation = read_manifest(tier, checkpoint_id, trust=trust).generation
        return read_status(tier, checkpoint_id, generation, node)

    try:
        status = prober.ask(tier, question, what="read a mirror record", direct=is_host_memory(tier))
    except FileNotFoundError:  # deleted by retention since it was listed
        return MirrorState(tier.name, node, checkpoint_id, None, reason="gone since listed")
    except (TierstoreError, OSError) as exc:
        return MirrorState(tier.name, node, checkpoint_id, False, reason=f"unreadable: {exc}")
    if status is None:
        return MirrorState(tier.name, node, checkpoint_id, None, reason="no mirror record yet")
    return MirrorState(tier.name, node, checkpoint_id, status.mirrored, status.holder_node, status.reason)


def _promoter_view(tiers: list[Tier], node: int, now: float, prober: Prober, away: set[str]) -> PromoterView:
    """The newest record node ``node``'s promoter left in the tiers it writes it to (``away``:
    tiers that did not answer, not asked again)."""
    newest: PromoterState | None = None
    problems = []
    for tier in [t for t in tiers if t.node_local] or tiers[:1]:
        if tier.name in away:
            problems.append(f"its record in tier {tier.name} cannot be read: the tier is unreachable")
            continue
        try:
            state = prober.ask(
                tier,
                functools.partial(read_state, tier, node),
                what="read the promoter's record",
                direct=is_host_memory(tier),
            )
        except (TierstoreError, OSError) as exc:
            problems.append(str(exc))
            continue
        if state is not None and (newest is None or state.at > newest.at):
            newest = state
    if newest is None:
        why = "; ".join(problems) or "no promoter has run on this node (no record in its tiers)"
        return PromoterView(node, False, why)
    ok, why = newest.health(now)
    return PromoterView(node, ok, why, newest)


def render(report: StatusReport) -> list[str]:
    """The report as lines for people: a table of tiers, then the recovery point, the mirrors,
    the promoters and the problems found."""
    rows = [("TIER", "NODE", "STATE", "CHECKPOINTS", "SIZE", "SPACE", "NEWEST", "LAG")]
    for tier in report.tiers:
        node = "-" if tier.node is None else str(tier.node)
        if tier.error is not None:
            rows.append((tier.name, node, "unreachable", "-", "-", "-", "-", "-"))
            continue
        held = str(tier.checkpoints) + ("" if tier.keep is None else f"/{tier.keep}")
        newest = "-" if tier.newest is None else tier.newest.checkpoint_id
        lag = "-" if tier.lag_s is None else human_age(tier.lag_s)
        rows.append(
            (tier.name, node, "ok", held, human_bytes(tier.bytes), _space_text(tier.space), newest, lag)
        )
    lines = _table(rows)
    if report.durable is not None:
        lag = human_age(report.recovery_point_lag_s or 0.0)
        lines.append(
            f"recovery point: {report.durable.checkpoint_id} in the durable tier, its data {lag} old"
        )
    elif not report.durable_reachable:
        away = ", ".join(sorted({t.name for t in report.tiers if t.durable}))
        lines.append(f"recovery point: unknown: the durable tier {away} is unreachable")
    elif report.newest is not None:
        lines.append("recovery point: nothing in the durable tier yet")
    if report.newest is not None:
        lines.append(
            f"newest committed: {report.newest.checkpoint_id},"
            f" its data {human_age(report.at - report.newest.started_at)} old"
        )
    for mirror in report.mirrors:
        if mirror.mirrored:
            held_by = "a partner" if mirror.holder_node is None else f"node {mirror.holder_node}"
            state = f"held by {held_by}"
        elif mirror.mirrored is None:
            state = f"unknown ({mirror.reason})"
        else:
            state = "NOT mirrored" + (f" ({mirror.reason})" if mirror.reason else "")
        lines.append(f"mirror: {mirror.tier} node {mirror.node}: {mirror.checkpoint_id} {state}")
    for promoter in report.promoters:
        lines.append(f"promoter: node {promoter.node} {promoter.why}")
    problems = report.problems()
    lines.append("problems: none" if not problems else f"problems ({len(problems)}):")
    lines.extend(f"  - {problem}" for problem in problems)
    return lines


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _space_text(space: Space | None) -> str:
    if space is None or space.total <= 0:
        return "-"
    share = space.used / space.total
    return f"{human_bytes(space.used)} of {human_bytes(space.total)} ({share:.0%})"


def _newest(candidates: list[Newest | None]) -> Newest | None:
    present = [c for c in candidates if c is not None]
    return max(present, key=lambda c: c.committed_at, default=None)


def _where(tier: TierStatus) -> str:
    return tier.name if tier.node is None else f"{tier.name} (node {tier.node})"


def _space_dict(space: Space | None) -> dict[str, int] | None:
    return None if space is None else {"used": space.used, "total": space.total}
