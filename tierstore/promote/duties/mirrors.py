"""Mirror upkeep: retention of the peer mirrors this node holds, and whether its own part of each
mirrored tier's newest checkpoint has a mirror (:mod:`tierstore.records.mirror`)."""

from __future__ import annotations

import functools

from tierstore._platform.health import said_once
from tierstore.errors import TierstoreError
from tierstore.promote.duties import Context, Outcome, event, logger
from tierstore.promote.view import View
from tierstore.records.activity import live
from tierstore.records.mirror import read_status
from tierstore.records.mirror_retention import prune_mirrors
from tierstore.tiers import Tier


def prune(view: View, ctx: Context) -> Outcome:
    """Keep no mirror beyond the tier's ``keep`` (a node that stopped receiving mirrors, or whose
    partner left the job, keeps none beyond it); a mirror a restore reads stays. Runs after
    retention, in every tier with a mirror, whether the view lists it or not."""
    ttl = ctx.config.promote.activity_ttl
    for tier in ctx.tiers:
        if ctx.config.mirror_of(tier.name) is None:
            continue
        try:
            ctx.ask(
                tier,
                functools.partial(_prune, tier, ctx.config.policy(tier.name).keep, ttl),
                what="prune mirrors",
            )
        except (TierstoreError, OSError) as exc:
            logger.log(said_once(tier), "retention of the mirrors in %s failed: %s", tier.name, exc)
    return Outcome()


def _prune(tier: Tier, keep: int | None, ttl: float) -> None:
    """Prune the mirrors in ``tier`` beyond ``keep``, none a restore reads; an event for each."""
    readers = [a for a in live(tier, ttl=ttl) if a.kind == "read"]
    for removed in prune_mirrors(tier, keep, readers=readers, ttl=ttl):
        event("mirror_deleted", tier=tier.name, mirror=removed)


def status(view: View, ctx: Context) -> Outcome:
    """The ``tierstore_mirrored`` gauge of each mirrored tier: whether this node's part of its newest
    checkpoint has a mirror (the save's own record)."""
    for tier in ctx.tiers:
        seen = [s.copy for s in view.found.get(tier.name, {}).values()]
        if ctx.config.mirror_of(tier.name) is None or not seen:
            continue
        newest = max(seen, key=lambda c: (c.seq or 0, c.generation))
        try:
            read = functools.partial(read_status, tier, newest.checkpoint_id, newest.generation, ctx.node)
            record = ctx.ask(tier, read, what="read a mirror status")
        except (TierstoreError, OSError) as exc:
            logger.log(said_once(tier), "cannot read the mirror status of %s: %s", newest.checkpoint_id, exc)
            continue
        if record is not None:
            ctx.metrics.mirrored.labels(tier.name).set(1 if record.mirrored else 0)
    return Outcome()
