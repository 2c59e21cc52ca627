"""The promoter's duties: what each is handed and hands back.

A pass (:mod:`tierstore.promote.sidecar`) makes one :class:`~tierstore.promote.view.View` and runs
small duties over it, in an order that matters: confirm part numbers right after every refresh look
(:mod:`.confirm`), then promote (:mod:`.promote`), detect and settle conflicts (:mod:`.conflicts`),
retain (:mod:`.retain`) and prune mirrors, collect garbage when due (:mod:`.collect`), and last what
the pass saw (:mod:`.sightings`, :mod:`.report`, :mod:`.mirrors`). A duty acts on the view it is
handed (it lists nothing the view answers) and with the :class:`Context`; a tier error is logged and
skips that tier. It returns an :class:`Outcome`: what it did, the view later duties act on if it
changed what the pass holds, and which listings the next look must make afresh. Which tiers this
node looks after is the view's ``owned``: its node-local tiers and the job-wide tiers whose lease it
held at the look (:mod:`tierstore.promote.keeper`); a duty asks ``Context.keepers.fence`` again
right before it changes a job-wide tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierstore.promote.cleanup import Cleanup
from tierstore.promote.context import Availability, Context, event, logger
from tierstore.promote.policy import Deletion, Promotion
from tierstore.promote.view import View

__all__ = ["Availability", "Context", "Outcome", "PassReport", "event", "logger"]


@dataclass
class PassReport:
    """What one pass did: the duties' outcomes, added up by the loop."""

    promoted: list[Promotion] = field(default_factory=list)
    failed: list[tuple[Promotion, str]] = field(default_factory=list)
    deleted: list[Deletion] = field(default_factory=list)
    cleaned: list[Cleanup] = field(default_factory=list)


@dataclass(frozen=True)
class Outcome:
    """What a duty did, and what the loop must know of it."""

    view: View | None = None
    """The view later duties act on, when this duty changed what the pass holds (None: unchanged)."""
    forget: frozenset[str] = frozenset()
    """Tiers whose kept listing the next look must not reuse."""
    refresh: bool = False
    """Decided on a reused listing: look at every tier afresh, then run the duty again."""
    promoted: tuple[Promotion, ...] = ()
    failed: tuple[tuple[Promotion, str], ...] = ()
    deleted: tuple[Deletion, ...] = ()
    cleaned: tuple[Cleanup, ...] = ()
