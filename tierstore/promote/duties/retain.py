"""Retain: delete what retention no longer keeps on this node (:func:`~tierstore.promote.policy.retention`,
and this node's parts of replaced saves coordinated elsewhere), marker first, then data
(:mod:`tierstore.promote.retention`).

Deletions are decided by listings made now: when the view reused an earlier listing of some tier
(:mod:`tierstore.promote.views`) and retention would delete anything, the duty asks the loop to look
at every tier afresh (``Outcome.refresh``) and decides again on that look (of a job-wide tier
another node keeps, its keeper's index made under the stamp read then counts as such a look:
:mod:`tierstore.promote.view`). An id named by a live activity record in a tier the view lists and
this node looks after is in use; when those records cannot be read in one tier, nothing is deleted
in this pass.
"""

from __future__ import annotations

import functools
import logging

from tierstore._platform.health import said_once
from tierstore._platform.killpoints import kill_point
from tierstore.errors import TierstoreError, TierUnavailableError
from tierstore.promote.duties import Context, Outcome, event, logger
from tierstore.promote.policy import Deletion, Rules, retention, superseded_parts
from tierstore.promote.retention import delete_copy
from tierstore.promote.view import View
from tierstore.records.activity import live


def plan(view: View, rules: Rules, in_use: frozenset[str]) -> list[Deletion]:
    """What retention deletes now on this node (pure): the policy's deletions and this node's
    superseded parts (ids in use left alone), in the tiers it looks after, without a part whose
    number is not confirmed yet (:mod:`.confirm`)."""
    held = view.copies()
    decided = retention(rules, held, in_use, unavailable=view.away())
    for name, parts in view.parts.items():
        if name not in view.found or name in view.unreachable:
            continue
        settled = {
            checkpoint_id: {
                gen: (records[0].seq, all(r.confirmed for r in records)) for gen, records in gens.items()
            }
            for checkpoint_id, gens in parts.items()
            if checkpoint_id not in in_use
        }
        decided += superseded_parts(name, settled, held)
    return [d for d in decided if view.owns(d.tier) and not _unconfirmed(view, d)]


def in_use(view: View, ctx: Context) -> frozenset[str] | None:
    """The ids a live activity record names in the tiers ``view`` lists and this node looks after
    (None: one could not be read, so nothing may be deleted). A record guards only the copies of
    its own tier, and this node deletes nothing in a tier not listed nor in one another node keeps
    (whose records it would have to list, every node after every save)."""
    ids: set[str] = set()
    for tier in ctx.tiers:
        if tier.name in view.unreachable or tier.name not in view.found or not view.owns(tier.name):
            continue
        read = functools.partial(live, tier, ttl=ctx.config.promote.activity_ttl)
        try:
            ids |= {record.checkpoint_id for record in ctx.ask(tier, read, what="read its activity records")}
        except (TierstoreError, OSError) as exc:
            logger.log(
                said_once(tier),
                "cannot read activity records in %s (%s): no deletion this pass",
                tier.name,
                exc,
            )
            return None
    return frozenset(ids)


def planned(view: View, ctx: Context) -> list[Deletion]:
    """:func:`plan` with the ids in use now. Their records are read only when the plan deletes
    anything: an id in use only takes deletions away, so a plan that deletes nothing with none in
    use deletes nothing with some (an idle pass lists no activity records)."""
    if not plan(view, ctx.rules, frozenset()):
        return []
    busy = in_use(view, ctx)
    return [] if busy is None else plan(view, ctx.rules, busy)


def run(view: View, ctx: Context, *, dry_run: bool = False) -> Outcome:
    """Delete what :func:`planned` decides (``dry_run``: only say what, as ``deleted``); the view
    handed back no longer holds what went."""
    deletions = planned(view, ctx)
    if deletions and view.reused:
        return Outcome(refresh=True)
    if dry_run:
        return Outcome(deleted=tuple(deletions))
    ttl = ctx.config.promote.activity_ttl
    kill_point("retention.decided", " ".join(f"{d.tier}/{d.checkpoint_id}" for d in deletions))
    done: list[Deletion] = []
    for deletion in deletions:
        if not ctx.keepers.fence(deletion.tier):  # asked right before each goes
            continue
        tier, generation = ctx.by_name[deletion.tier], deletion.generation or None
        drop = functools.partial(
            delete_copy, tier, deletion.checkpoint_id, generation, trust=ctx.trust, ttl=ttl
        )
        try:
            ctx.ask(tier, drop, what=f"delete {deletion.checkpoint_id}")
        except (TierstoreError, OSError) as exc:  # that copy stays, until a later pass
            level = said_once(tier) if isinstance(exc, TierUnavailableError) else logging.ERROR
            logger.log(level, "deleting %s from %s failed: %s", deletion.checkpoint_id, tier.name, exc)
            continue
        ctx.metrics.deleted.labels(deletion.tier).inc()
        event("deleted", checkpoint=deletion.checkpoint_id, tier=deletion.tier, reason=deletion.reason)
        done.append(deletion)
        kill_point("retention.between_deletes", deletion.checkpoint_id)
    return Outcome(view=view.without(done), deleted=tuple(done))


def _unconfirmed(view: View, deletion: Deletion) -> bool:
    """True when ``deletion`` is of this node's part of a save coordinated elsewhere whose number is
    still the planned one: retention ranks by commit order, and that save may have committed after
    the ones it is ranked below. It waits until its number is confirmed."""
    seen = view.found.get(deletion.tier, {}).get(deletion.checkpoint_id)
    if seen is None or not seen.copy.partial or seen.copy.generation != deletion.generation:
        return False
    return not all(record.confirmed for record in seen.parts)
