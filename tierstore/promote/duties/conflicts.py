"""Conflicts: two contents under one id, both kept (:mod:`tierstore.records.conflicts`).

Every id held by a tier and a tier below at different generations, whose saves did not know of each
other (:func:`~tierstore.records.protocol.judge_promotion`), gets a conflict record in the upper
tier, whether or not it would be promoted there: neither content is dropped silently (commit numbers
taken without that knowledge may even be equal). Runs after the promotions, before retention: the
copies it finds in conflict are kept by retention in this very pass. Records that no longer hold are
dropped, and promotion of the copy, if it still belongs below, resumes at the next pass.
"""

from __future__ import annotations

import dataclasses
import functools

from tierstore._platform.health import said_once
from tierstore.errors import TierstoreError
from tierstore.promote.context import Progress
from tierstore.promote.discovery import SeenCopy, marker_of
from tierstore.promote.duties import Context, Outcome, event, logger
from tierstore.promote.view import View
from tierstore.records.conflicts import Conflict, clear_conflict, record_conflict
from tierstore.records.marker import Manifest
from tierstore.records.protocol import Verdict, judge_promotion
from tierstore.tiers import Tier


def report(ctx: Context, source: Tier, target: Tier, seen: SeenCopy, existing: Manifest) -> Conflict | None:
    """Keep both contents of the id: a record in the source tier (retention keeps the copy,
    promotion stops retrying it), an error line; the record if it is new."""
    mine = seen.manifest
    assert mine is not None
    _verdict, why = judge_promotion(mine, existing, source_tier=source.name, target=target.name)
    conflict = Conflict(
        mine.checkpoint_id, mine.generation, mine.seq, target.name, existing.generation, existing.seq, why
    )
    try:
        if not ctx.ask(
            source, functools.partial(record_conflict, source, conflict), what="record a conflict"
        ):
            return None
    except (TierstoreError, OSError) as exc:
        logger.error("could not record the conflict of %s: %s", conflict.describe(), exc)
        return None
    generations = {"generation": conflict.generation, "target_generation": conflict.target_generation}
    event("conflict", checkpoint=conflict.checkpoint_id, tier=source.name, target=target.name, **generations)
    logger.error(
        "not promoted, both kept: %s. Keep one: `tierstore drop %s --tier NAME` on the"
        " other, or save it again with overwrite=True",
        conflict.describe(),
        conflict.checkpoint_id,
    )
    return conflict


def run(view: View, ctx: Context) -> Outcome:
    """Detect, then settle (see the module docstring); the view handed back marks the copies found
    in conflict and holds the records as settled."""
    found = {name: dict(seen) for name, seen in view.found.items()}
    records = {name: list(known) for name, known in view.conflicts.items()}
    acting = {
        t.name for t in ctx.tiers if t.name in found and view.owns(t.name) and ctx.keepers.fence(t.name)
    }
    for upper_index, upper in enumerate(ctx.tiers):
        if upper.name not in acting:
            continue
        for lower in ctx.tiers[upper_index + 1 :]:
            for checkpoint_id, seen in found[upper.name].items():
                there = found.get(lower.name, {}).get(checkpoint_id)
                if there is None or not there.committed or not seen.committed:
                    continue
                if there.copy.generation == seen.copy.generation or lower.name in seen.copy.conflicts:
                    continue
                markers = _markers(ctx, (upper, seen), (lower, there))
                if markers is None:
                    continue
                mine, theirs = markers
                verdict, _why = judge_promotion(mine, theirs, source_tier=upper.name, target=lower.name)
                if verdict is Verdict.CONFLICT:
                    new = report(ctx, upper, lower, dataclasses.replace(seen, manifest=mine), theirs)
                    if new is not None:
                        records.setdefault(upper.name, []).append(new)
                    # retention in this very pass must keep it too
                    copy = dataclasses.replace(seen.copy, conflicts=seen.copy.conflicts | {lower.name})
                    found[upper.name][checkpoint_id] = dataclasses.replace(seen, copy=copy)
    for tier in ctx.tiers:
        if tier.name in acting:
            _settle(tier, records.setdefault(tier.name, []), found, ctx)
    conflicts = {name: tuple(known) for name, known in records.items()}
    return Outcome(view=dataclasses.replace(view, found=found, conflicts=conflicts))


def _markers(ctx: Context, *copies: tuple[Tier, SeenCopy]) -> tuple[Manifest, Manifest] | None:
    """The manifests of two committed copies; a copy seen through its keeper's index has its
    marker read now (within ``probe_timeout``). None, with a warning, when one cannot be read."""
    manifests = []
    for tier, seen in copies:
        try:
            read = functools.partial(marker_of, seen, tier, ctx.trust)
            manifests.append(ctx.ask(tier, read, what=f"read the marker of {seen.copy.checkpoint_id}"))
        except (TierstoreError, OSError) as exc:
            where = (seen.copy.checkpoint_id, tier.name, exc)
            logger.log(said_once(tier), "cannot read the marker of %s in %s: %s", *where)
            return None
    return manifests[0], manifests[1]


def _settle(
    tier: Tier, conflicts: list[Conflict], found: dict[str, dict[str, SeenCopy]], ctx: Context
) -> None:
    """Drop ``tier``'s conflict records that no longer hold (either content is gone or was replaced)."""

    def settle(progress: Progress) -> None:
        for conflict in list(conflicts):
            here = found[tier.name].get(conflict.checkpoint_id)
            there = found.get(conflict.target, {}).get(conflict.checkpoint_id)
            settled = here is None or here.copy.generation != conflict.generation
            if conflict.target in found:  # a target that cannot be listed settles nothing
                settled = settled or there is None or there.copy.generation != conflict.target_generation
            if settled:
                clear_conflict(tier, conflict)
                conflicts.remove(conflict)
                event(
                    "conflict_settled",
                    checkpoint=conflict.checkpoint_id,
                    tier=tier.name,
                    target=conflict.target,
                )
                progress(1)

    try:
        ctx.bounded(tier, settle, what="settle its conflict records")
    except (TierstoreError, OSError) as exc:
        logger.log(said_once(tier), "cannot settle the conflict records of %s: %s", tier.name, exc)
    ctx.metrics.conflicts.labels(tier.name).set(len(conflicts))
