"""The writer's staging face (DCP step 0, ``async_save`` only): the copy into this process's
reusable buffers for the tier (:mod:`tierstore.dcp.staging`), the report of the trainer's stall,
and the hand-over of the staged save to the thread that carries it (the back-pressure signal)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tierstore._platform.owners import owner_dir_name
from tierstore.dcp.save_plans import RankReport
from tierstore.dcp.staging import STAGERS, StagedSave, Stager, StagingFuture
from tierstore.ids import writer_staging_dir
from tierstore.tiers import OwnedDirectory

if TYPE_CHECKING:
    from tierstore.dcp.writer import TieredWriter

logger = logging.getLogger(__name__)


def stage(writer: TieredWriter, state_dict: dict[str, Any]) -> dict[str, Any] | StagingFuture:
    """Copy ``state_dict`` into the buffers, on this thread or (``overlap``) in the background."""
    started_wall, started = time.time(), time.perf_counter()
    stager = stager_for_this_process(writer)
    record = functools.partial(_record_staged, writer, (started_wall, started))
    if not writer.overlap:
        return record(stager.stage(state_dict))
    # record() runs on the staging thread before the future resolves, so DCP's save thread
    # (which waits for the future) sees this save's slab, report and pending; the previous
    # save from this writer is over by then (the back-pressure wait comes first).
    return stager.stage_in_background(state_dict, record)


def _record_staged(writer: TieredWriter, started: tuple[float, float], staged: StagedSave) -> dict[str, Any]:
    """Record a finished copy for the save that carries it; returns the staged state."""
    started_wall, started_at = started
    writer._slab = staged.slab
    writer._pending = staged.pending  # the save's thread reports in through this
    waited = staged.waited
    # With overlap, the time until staging_completion: the most the trainer can have waited.
    stall = time.perf_counter() - started_at
    if waited > 0.01:
        logger.warning(
            "async save waited %.3f s for the previous save to tier %s to finish persisting"
            " (or for its spare buffer); save less often, or wait for the previous future",
            waited,
            writer.tier_name,
        )
    writer._stage_report = RankReport(writer.node, started_wall, stall, waited)
    return staged.state  # type: ignore[no-any-return]


def register_save_thread(writer: TieredWriter, *, in_process: bool = True) -> None:
    """The thread carrying a staged save says so: the next stage() waits for the save to be
    over (see :mod:`tierstore.dcp.staging.pending`)."""
    if writer._pending is not None:
        writer._pending.register(threading.current_thread(), in_process=in_process)
        writer._carried, writer._pending = writer._pending, None


def settle(writer: TieredWriter) -> None:
    """This rank's part of the save it carries is done (see :meth:`Pending.settle`)."""
    carried, writer._carried = writer._carried, None
    if carried is not None:
        carried.settle()


def _stager_key(writer: TieredWriter) -> str:
    return f"{writer.tier.root}|{writer.tier_name}"


def stager_for_this_process(writer: TieredWriter) -> Stager:
    """The stager this process keeps for the tier (a forked child has its own)."""

    def directory() -> OwnedDirectory | None:
        if not writer.tier.capabilities.staging_files:
            return None  # anonymous shared memory, reused save after save
        return writer.tier.own_directory(writer_staging_dir(owner_dir_name()))

    return STAGERS.get().get(_stager_key(writer), directory)


def wait_for_staging(writer: TieredWriter) -> None:
    """Wait for this process's overlapped staging into the tier, if it has a stager."""
    stager = STAGERS.get().peek(_stager_key(writer))
    if stager is not None:
        stager.queue.wait_until_idle()


def release(writer: TieredWriter) -> None:
    """Release this process's staging buffers for the tier, once its staging is idle."""
    stager_for_this_process(writer).wait_until_idle()
    stager = STAGERS.get().discard(_stager_key(writer))
    if stager is not None:
        stager.close()
