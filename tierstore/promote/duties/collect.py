"""Collect garbage: remove uncommitted leftovers in the tiers this node looks after
(:mod:`tierstore.promote.cleanup`), now and then: a pass sweeps a tier when its last complete sweep
ended ``every`` ago (``min(promote.stale_after / 2, 10 min)``): this process's own, or before it has
made one, its predecessor's, as the tier's sweep record says (:mod:`tierstore.records.sweeps`: a
restarted promoter does not list 10,000 retained checkpoints again at once); ``tierstore gc``
whenever asked.

Each tier is looked at afresh (:func:`~tierstore.promote.cleanup.find_leftovers`): the view, made
earlier in the pass, would not know of commits made since. Only its reachability is used. The
markers that look lists are taken from the promoter's marker cache where it trusts them at the
mtime listed then, and read otherwise.
"""

from __future__ import annotations

import functools
import math
import time

from tierstore._platform.health import said_once
from tierstore._platform.killpoints import kill_point
from tierstore.errors import TierstoreError
from tierstore.promote.cleanup import VOID_BELOW_TOP, Cleanup, find_leftovers, remove
from tierstore.promote.context import Progress
from tierstore.promote.duties import Context, Outcome, event, logger
from tierstore.promote.view import View
from tierstore.records.sweeps import record_sweep, since_sweep
from tierstore.tiers import Tier


def run(
    view: View,
    ctx: Context,
    *,
    dry_run: bool = False,
    stale_after: float | None = None,
    every: float | None = None,
) -> Outcome:
    """Remove (or with ``dry_run`` only list) the leftovers, as ``cleaned``: those left alone for
    ``stale_after`` (default ``promote.stale_after``; 0 with ``dry_run``: every one, however young),
    in the tiers whose sweep is due (``every``; None: every tier). Each tier's look and removals
    are one piece of work with a deadline on its progress (a step of the look, a removal): a tier
    that stops answering is left for this time."""
    ttl = ctx.config.promote.activity_ttl
    stale = ctx.config.promote.stale_after if stale_after is None else stale_after
    cleanups: list[Cleanup] = []

    def clean(tier: Tier, progress: Progress) -> None:
        if every is not None and not _due(tier, ctx, every):
            return
        leftovers = find_leftovers(
            tier, trust=ctx.trust, stale_after=stale, activity_ttl=ttl, cache=ctx.cache, progress=progress
        )
        failed = False
        for cleanup in leftovers:
            if not dry_run:
                if not ctx.keepers.fence(tier.name):  # taken over while cleaning: stop here
                    return
                try:
                    remove(tier, cleanup, trust=ctx.trust, activity_ttl=ttl)
                except (TierstoreError, OSError) as exc:
                    logger.warning("gc of %s in %s failed: %s", cleanup.path, tier.name, exc)
                    failed = True
                    continue
                if cleanup.reason == VOID_BELOW_TOP:  # bookkeeping of the log, every commit
                    logger.debug("cleaned %s in %s: %s", cleanup.path, tier.name, cleanup.reason)
                else:
                    event("cleaned", tier=tier.name, path=cleanup.path, reason=cleanup.reason)
                kill_point("cleanup.between_removals", cleanup.path)
                progress(1)
            cleanups.append(cleanup)
        if not dry_run:
            ctx.swept[tier.name] = time.monotonic()  # this process tries a failed removal next time
            if not failed and ctx.keepers.fence(tier.name):  # a restart tries it at once
                record_sweep(tier)

    for tier in ctx.tiers:
        if not view.owns(tier.name) or tier.name in view.unreachable or not ctx.keepers.fence(tier.name):
            continue
        try:
            ctx.bounded(tier, functools.partial(clean, tier), what="clean up its leftovers")
        except (TierstoreError, OSError) as exc:
            logger.log(said_once(tier), "gc of %s skipped: %s", tier.name, exc)
    return Outcome(cleaned=tuple(cleanups))


def _due(tier: Tier, ctx: Context, every: float) -> bool:
    """Whether ``tier``'s last complete sweep ended ``every`` ago: this process's, else the one its
    sweep record tells of (read once; on the tier's clock, so this host's clock cannot make a sweep
    look older than it is)."""
    if tier.name not in ctx.swept:
        since = since_sweep(tier)  # negative: stamped ahead of the tier's clock (stepped back): no record
        ctx.swept[tier.name] = -math.inf if since is None or since < 0 else time.monotonic() - since
    return time.monotonic() - ctx.swept[tier.name] >= every
