"""The planned save's ``write`` record: held from the coordinator's plan to the end of its commit.

Cleanup leaves a generation with a live ``write`` record alone, however invisible its parts. A save
that ends without committing (a veto, a failure on any rank, a refusal, a writer collected mid-save)
is remembered as failed, so the other nodes drop their parts of it at the next plan
(:func:`tierstore.records.protocol.settle_parts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierstore._platform.runtime import finalize
from tierstore.dcp.known_commits import look_elsewhere
from tierstore.records.activity import Activity, hold
from tierstore.records.known import Elsewhere

if TYPE_CHECKING:
    from tierstore.dcp.writer import TieredWriter

logger = logging.getLogger(__name__)


def start_writing(writer: TieredWriter, checkpoint_id: str, generation: str) -> None:
    """Coordinator, before any rank writes: announce the save's generation in the target tier."""
    stop_writing(writer)  # a previous save by this writer that failed after planning
    writer._writing = hold(
        writer.tier, "write", checkpoint_id, generation, ttl=writer.config.promote.activity_ttl
    )
    # A failed save's record ends with its writer (one finaliser at a time: see stop_writing).
    writer._writing_ends = finalize(
        writer, _abandoned, writer._writing, look_elsewhere(writer, True), writer.tier.name
    )


def stop_writing(writer: TieredWriter, *, committed: bool = False) -> None:
    """End the planned save's ``write`` record; without ``committed`` the save is remembered as
    failed in this process's knowledge of the tiers."""
    if writer._writing_ends is not None:
        writer._writing_ends.detach()  # a writer reused for many saves keeps none of the old ones
        writer._writing_ends = None
    if writer._writing is not None:
        _abandoned(writer._writing, None if committed else writer._elsewhere, writer.tier_name)
        writer._writing = None


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
