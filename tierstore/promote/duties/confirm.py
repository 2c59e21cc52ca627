"""Confirm numbers: this node's parts of multi-node saves carry the commit number claimed when the
save was planned; the coordinator may have taken a higher one at its commit (a save that committed
meanwhile). Once the final number is in a job-wide tier (the id's marker there, or the committed
manifest the coordinator's node left, ``parts/manifest.json``), the part records are rewritten with
it (``confirmed``) and the tier is looked at again: this node's part then ranks, and is promoted, by
it, like the coordinator's.

Runs right after every refresh look, before promotion and retention: parts rank by their number,
and retention holds a part whose number is not confirmed yet (:mod:`.retain`).
"""

from __future__ import annotations

import dataclasses
import functools

from tierstore._platform.health import said_once
from tierstore.errors import TierstoreError
from tierstore.ids import intent_path
from tierstore.promote.discovery import SeenCopy, discover, foreign_parts
from tierstore.promote.duties import Context, Outcome, logger
from tierstore.promote.view import Parts, View
from tierstore.records.conflicts import Conflict
from tierstore.records.marker import Manifest
from tierstore.records.parts import PartRecord
from tierstore.records.protocol import confirm_part
from tierstore.tiers import Tier


class ConfirmNumbers:
    """The duty, with the final numbers it learnt (see the module docstring)."""

    def __init__(self) -> None:
        self._final: dict[tuple[str, str], int | None] = {}
        """The commit number of multi-node saves, from their committed manifest in a job-wide tier."""

    def run(self, view: View, ctx: Context) -> Outcome:
        """Confirm what can be in every node-local tier of ``view``; the tiers it rewrote parts in
        are listed again (the view handed back) and their kept listings forgotten."""
        unknown: set[tuple[str, str]] = set()  # not committed yet: asked again at the next look
        found, parts, relisted = dict(view.found), dict(view.parts), set()
        for tier in ctx.tiers:
            if not tier.node_local or tier.name not in view.found:
                continue
            try:
                changed = False
                for generations in view.parts.get(tier.name, {}).values():
                    for records in generations.values():
                        first = records[0]
                        if all(r.confirmed for r in records):
                            continue
                        final = self._final_number(view, ctx, first, unknown)
                        if final is not None:
                            confirm = functools.partial(
                                confirm_part, tier, first.checkpoint_id, first.generation, final
                            )
                            changed |= ctx.ask(tier, confirm, what="confirm a part's number")
                if changed:  # their records were rewritten (and the tier stamped): list it again
                    known = list(view.conflicts.get(tier.name, ()))
                    relist = functools.partial(_relist, ctx, tier, known)
                    found[tier.name], parts[tier.name] = ctx.ask(tier, relist, what="list it again")
                    relisted.add(tier.name)
            except (TierstoreError, OSError) as exc:
                where = (tier.name, exc)
                logger.log(
                    said_once(tier), "cannot confirm the commit numbers of the parts in %s: %s", *where
                )
        if not relisted:
            return Outcome()
        return Outcome(view=dataclasses.replace(view, found=found, parts=parts), forget=frozenset(relisted))

    def _final_number(
        self, view: View, ctx: Context, part: PartRecord, unknown: set[tuple[str, str]]
    ) -> int | None:
        """The part's generation's number as committed: from a job-wide tier's marker of it, else
        its committed manifest there (each asked within ``probe_timeout``); None while unknown."""
        wide = [t for t in ctx.tiers if not t.node_local and t.name in view.found]
        key = (part.checkpoint_id, part.generation)
        for tier in wide:
            there = view.found[tier.name].get(part.checkpoint_id)
            if there is not None and not there.copy.partial and there.copy.generation == part.generation:
                return there.copy.seq
        if key in self._final or key in unknown:
            return self._final.get(key)
        unknown.add(key)
        path = intent_path(part.checkpoint_id, part.generation)
        for tier in wide:
            try:
                blob = ctx.ask(tier, functools.partial(tier.read_bytes, path), what=f"read {path}")
                self._final[key] = Manifest.from_json(blob, where=f"tier {tier.name}: {path}").seq
                return self._final[key]
            except FileNotFoundError:
                continue
            except (TierstoreError, OSError) as exc:
                logger.log(said_once(tier), "cannot read %s in %s: %s", path, tier.name, exc)
        return None


def _relist(ctx: Context, tier: Tier, conflicts: list[Conflict]) -> tuple[dict[str, SeenCopy], Parts]:
    """The copies ``tier`` holds and this node's parts there, listed now."""
    return discover(tier, ctx.cache, conflicts), foreign_parts(tier, ctx.cache)
