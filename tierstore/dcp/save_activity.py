"""The planned save's ``write`` record: held from the coordinator's plan to the end of its commit.

Cleanup leaves a generation with a live ``write`` record alone, however invisible its parts. A save
that ends without committing (a veto, a failure on any rank, a refusal, a writer collected mid-save)
is remembered as failed, so the other nodes drop their parts of it at the next plan
(:func:`tierstore.records.protocol.settle_parts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tierstore._platform.runtime import finalize
from tierstore.dcp.save_session import SaveSession
from tierstore.records.activity import Activity, hold
from tierstore.records.known import Elsewhere

logger = logging.getLogger(__name__)


def start_writing(session: SaveSession) -> None:
    """Coordinator, before any rank writes: announce the save's generation in the target tier."""
    tier = session.tier
    writing = hold(
        tier, "write", session.checkpoint_id, session.generation, ttl=session.config.promote.activity_ttl
    )
    session.writing = writing
    # A failed save's record ends with its session (kept by the writer until its next save).
    session.writing_ends = finalize(session, _abandoned, writing, session.look_elsewhere(True), tier.name)


def stop_writing(session: SaveSession, *, committed: bool = False) -> None:
    """End the planned save's ``write`` record; without ``committed`` the save is remembered as
    failed in this process's knowledge of the tiers."""
    if session.writing_ends is not None:
        session.writing_ends.detach()
        session.writing_ends = None
    if session.writing is not None:
        elsewhere = None if committed else session.look_elsewhere(True)
        _abandoned(session.writing, elsewhere, session.tier_name)
        session.writing = None


def _abandoned(writing: Activity, elsewhere: Elsewhere | None, tier_name: str) -> None:
    """A planned save's ``write`` record ends; with ``elsewhere``, the save did not commit (also
    when its writer is collected mid-save: a failure before ``finish``)."""
    writing.release()
    if elsewhere is not None and writing.generation is not None:
        elsewhere.failed(tier_name, writing.checkpoint_id, writing.generation)


def quietly(action: Callable[[], object]) -> None:
    """Run a best-effort cleanup step of a failed save; a failure is logged, gc removes the rest."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - best-effort cleanup; gc removes what is left
        logger.warning("cleanup failed: %s", exc)
