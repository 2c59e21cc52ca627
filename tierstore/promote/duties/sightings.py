"""Sightings: what this node leaves in each tier it looks after at the end of a pass, so that saves
and restores there ask no other tier (:mod:`tierstore.records.sightings`), and the tier's change
stamp, once per process (:mod:`tierstore.records.changes`)."""

from __future__ import annotations

import functools

from tierstore._platform.health import said_once
from tierstore.errors import TierstoreError
from tierstore.promote.duties import Context, Outcome, logger
from tierstore.promote.view import View
from tierstore.records.protocol import restamp
from tierstore.records.sightings import Sighting, read_sightings, record_sighting


class Sightings:
    """The duty, with what it last left in each tier (rewritten only when it changes)."""

    def __init__(self) -> None:
        self._stamped: set[str] = set()
        """Tiers this process stamped."""
        self._sighted: dict[tuple[str, str], Sighting] = {}
        """``(tier, tier seen)`` -> the sighting last left there."""

    def run(self, view: View, ctx: Context) -> Outcome:
        """Stamp, then leave in every tier of ``view`` this node looks after what it saw in each
        other tier of ``view`` (which no longer holds what the pass deleted)."""
        self._stamp_once(view, ctx)
        for tier in ctx.tiers:
            if tier.name not in view.found or not view.owns(tier.name) or not ctx.keepers.fence(tier.name):
                continue
            for seen_name, seen in view.found.items():
                if seen_name == tier.name:
                    continue
                ids = {i: (s.copy.seq, s.copy.generation) for i, s in seen.items() if s.committed}
                highest = max([view.highest.get(seen_name, 0), *(seq or 0 for seq, _gen in ids.values())])
                sighting = Sighting(seen_name, highest, ids)
                key = (tier.name, seen_name)
                try:
                    if key not in self._sighted:
                        read = functools.partial(read_sightings, tier)
                        left = ctx.ask(tier, read, what="read its sightings").items()
                        self._sighted.update(((tier.name, n), known) for n, known in left)
                    known, every = self._sighted.get(key), ctx.config.promote.interval
                    record = functools.partial(record_sighting, tier, sighting, known, refresh_after=every)
                    if ctx.ask(tier, record, what="record its sightings"):
                        self._sighted[key] = sighting
                except (TierstoreError, OSError) as exc:
                    where = (seen_name, tier.name, exc)
                    logger.log(said_once(tier), "cannot record what %s holds in %s: %s", *where)
        return Outcome()

    def _stamp_once(self, view: View, ctx: Context) -> None:
        """Stamp each tier once per promoter process, at the end of the first pass that lists it
        (within ``probe_timeout``): a predecessor killed between a change and its stamp left that
        change unstamped, and every promoter sees it at its next pass (records/changes.py). After
        the pass's own look, so that a restart's first look is not slowed by it."""
        for tier in ctx.tiers:
            if tier.name in self._stamped or tier.name not in view.found:
                continue
            try:
                ctx.ask(tier, functools.partial(restamp, tier), what="stamp it")
            except (TierstoreError, OSError) as exc:
                logger.log(said_once(tier), "cannot stamp tier %s: %s", tier.name, exc)
                continue
            self._stamped.add(tier.name)
