"""Promote: copy committed checkpoints one tier further (:mod:`tierstore.promote.job`: verified data
first, marker last), as the policy plans (:func:`~tierstore.promote.policy.promotions`).

The loop plans on each look and promotes what is planned and not tried yet in this pass, one
promotion at a time, until the promoter is stopping; a look at the tiers follows each round, so a
checkpoint moves as many tiers as there are in one pass.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time

from tierstore._platform import health
from tierstore._platform.bounded import Blame
from tierstore._platform.killpoints import kill_point
from tierstore.errors import TierMisconfiguredError, TierstoreError, TierUnavailableError
from tierstore.promote.context import Progress
from tierstore.promote.discovery import marker_of
from tierstore.promote.duties import Context, Outcome, event, logger
from tierstore.promote.duties.conflicts import report
from tierstore.promote.job import Outcome as JobOutcome
from tierstore.promote.job import PromotionJob
from tierstore.promote.policy import Promotion, Rules, promotions
from tierstore.promote.transfer import Cancelled
from tierstore.promote.view import View
from tierstore.records.protocol import Verdict

KEPT = {
    Verdict.SAME: "the target already holds this commit",
    Verdict.KEEP_NEWER: "the target holds a newer commit of the id",
}
"""Why a promotion published nothing, by the protocol's verdict on the target's marker."""


def owed(view: View, rules: Rules) -> list[Promotion]:
    """Every promotion this node owes now: the policy's promotions around the tiers away, out of its
    node-local tiers and into the job-wide tiers it keeps (:func:`is_mine`), none out of a tier it
    cannot list. A tier away still has copies waiting for it: every copy due there that the
    reachable tiers hold (what it already holds is unknown while it cannot be listed)."""
    return [
        p
        for p in promotions(rules, view.copies(), view.away())
        if p.source not in view.unreachable and is_mine(p, view, rules)
    ]


def plan(view: View, rules: Rules, owed_now: list[Promotion] | None = None) -> list[Promotion]:
    """What this node promotes now: what it owes (:func:`owed`, unless given as ``owed_now``: the
    policy walks every copy of every tier), none into a tier it cannot list (retried once the
    tier answers again)."""
    return [
        p for p in (owed(view, rules) if owed_now is None else owed_now) if p.target not in view.unreachable
    ]


def is_mine(promotion: Promotion, view: View, rules: Rules) -> bool:
    """Whether this node makes ``promotion``: each node moves its node-local copies down; a copy
    already in a job-wide tier is moved further by the keeper of the tier it goes to."""
    local = {t.name for t in rules.tiers if t.node_local}
    return view.owns(promotion.source if promotion.source in local else promotion.target)


def backlog(due: list[Promotion], ctx: Context) -> int:
    """Export how many promotions wait (``due``: :func:`owed`), per target tier; return how many
    in all."""
    for tier in ctx.tiers[1:]:
        ctx.metrics.backlog.labels(tier.name).set(sum(p.target == tier.name for p in due))
    return len(due)


def run(promotion: Promotion, view: View, ctx: Context) -> Outcome:
    """Promote the copy ``view`` holds of ``promotion``. A failure forgets the listings of both
    tiers (the source may have lost the copy behind tierstore's back); a conflict found at the
    target is recorded, and the view handed back holds the record (the next look knows it)."""
    source, target = ctx.by_name[promotion.source], ctx.by_name[promotion.target]
    seen = view.found[promotion.source][promotion.checkpoint_id]
    named = {"checkpoint": promotion.checkpoint_id, "source": source.name, "target": target.name}
    what = (promotion.checkpoint_id, seen.copy.generation, source.name, target.name)
    logger.debug("promoting %s (generation %s) from %s to %s", *what)
    fence = None if source.node_local else lambda: ctx.keepers.fence(target.name)  # the keeper's work
    if fence is not None and not fence():
        return Outcome()
    if any(health.view().is_open(tier) for tier in (source, target)):
        return Outcome()  # found hung since the look (said once): the next look leaves it out
    if seen.committed and seen.manifest is None:  # seen through the source's index: read its marker
        try:
            read = functools.partial(marker_of, seen, source, ctx.trust)
            manifest = ctx.ask(source, read, what="read a marker")
        except (TierstoreError, OSError) as exc:
            return Outcome(forget=frozenset({source.name}), failed=((promotion, str(exc)),))
        if manifest.generation != seen.copy.generation:  # replaced since the index: look again
            return Outcome(forget=frozenset({source.name}))
        seen = dataclasses.replace(seen, manifest=manifest)
    if what in ctx.hanging:  # an earlier try still waits on a tier: another would wait beside it
        return Outcome()
    given_up = threading.Event()  # a job whose deadline passed may go on: it publishes nothing then
    blame = Blame(source)  # a hung read of the source is the source's fault, not the target's

    def copy(progress: Progress) -> JobOutcome:
        def beat(count: int) -> None:
            ctx.health.beat()
            progress(count)

        ctx.hanging.add(what)
        try:
            return job(beat)
        finally:
            ctx.hanging.discard(what)

    def job(beat: Progress) -> JobOutcome:
        return PromotionJob(
            source,
            target,
            seen,
            node=ctx.node,
            durable=target is ctx.tiers[-1],
            workers=ctx.config.promote.workers,
            stopping=ctx.stopping,
            cancel=ctx.cancel,
            trust=ctx.trust,
            activity_ttl=ctx.config.promote.activity_ttl,
            progress=beat,
            fence=lambda: not given_up.is_set() and (fence is None or fence()),
            blame=blame,
        ).run()

    started = time.monotonic()
    try:  # watched on the target, which takes what the source gives as it comes
        result = ctx.bounded(
            target, copy, what=f"promote {promotion.checkpoint_id} from {source.name}", blame=blame
        )
    except Cancelled:
        event("promotion_abandoned", checkpoint=promotion.checkpoint_id, target=target.name)
        return Outcome()
    except (TierstoreError, OSError) as exc:
        given_up.set()
        ctx.metrics.failures.labels(target.name).inc()
        if isinstance(exc, TierUnavailableError) and exc.tier == target.name:
            ctx.availability.set_unavailable(target.name, str(exc))
            if isinstance(exc, TierMisconfiguredError):
                ctx.availability.set_misconfigured(target.name, "write", str(exc))
        again = ctx.failing.get(what) == type(exc).__name__
        ctx.failing[what] = type(exc).__name__
        level = logging.DEBUG if again else logging.ERROR  # once per episode, not every pass
        event("promotion_failed", level, **named, error=str(exc).replace("\n", "; "))
        return Outcome(forget=frozenset({source.name, target.name}), failed=((promotion, str(exc)),))
    kill_point("promote.committed", promotion.checkpoint_id)
    ctx.failing.pop(what, None)
    seconds = time.monotonic() - started
    ctx.availability.set_unavailable(target.name, None)
    ctx.availability.set_misconfigured(target.name, "write", None)
    if result.verdict is Verdict.CONFLICT and result.existing is not None:
        conflict = report(ctx, source, target, seen, result.existing)
        return Outcome() if conflict is None else Outcome(view=view.with_conflict(source.name, conflict))
    ctx.metrics.bytes_promoted.labels(target.name).inc(result.copied)
    promoted: tuple[Promotion, ...] = ()
    if result.committed:
        ctx.metrics.checkpoints_promoted.labels(target.name).inc()
        ctx.metrics.promotion_seconds.labels(target.name).observe(seconds)
        promoted = (promotion,)
    if result.verdict in (Verdict.SAME, Verdict.KEEP_NEWER):  # nothing of ours was published
        event("promotion_skipped", **named, reason=KEPT[result.verdict])
    else:  # every byte copied was checked against the marker's CRC32C on the way (transfer.py)
        kind = "promoted" if result.committed else "part_copied"
        event(kind, **named, node=ctx.node, bytes=result.copied, seconds=seconds, verified="crc32c")
    return Outcome(promoted=promoted)
