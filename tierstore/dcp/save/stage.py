"""The writer's staging face (DCP step 0, ``async_save`` only): the copy into this process's
reusable buffers for the tier (:mod:`tierstore.dcp.staging`), the report of the trainer's stall,
and the hand-over of the staged save to the thread that carries it (the back-pressure signal)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tierstore._platform.owners import owner_dir_name
from tierstore.dcp.save.session import RankReport
from tierstore.dcp.staging import STAGERS, Pending, SlabInfo, StagedSave, Stager, StagingFuture
from tierstore.ids import writer_staging_dir
from tierstore.tiers import OwnedDirectory, Tier

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StageHandoff:
    """What ``stage()`` leaves for the save that carries it (slab at set-up, report in its plan)."""

    node: int
    tier_name: str
    slab: SlabInfo | None = None  # of the last staged state: never cleared, a retry of it re-uses it
    report: RankReport | None = None
    pending: Pending | None = None  # the staged save's, until its thread reports in
    carried: Pending | None = None  # the staged save this writer carries now
    last: Pending | None = None  # the last staged save's, for its owner to finish (over_when)

    def stage(
        self, stager: Callable[[], Stager], state: dict[str, Any], overlap: bool
    ) -> dict[str, Any] | StagingFuture:
        """Copy ``state`` into the buffers of ``stager()``, on this thread or (``overlap``) in the
        background."""
        started = time.time(), time.perf_counter()
        into = stager()
        record = functools.partial(self._record, started)
        if not overlap:
            return record(into.stage(state))
        # record() runs on the staging thread before the future resolves, so DCP's save thread
        # (which waits for the future) sees this save's slab, report and pending; the previous
        # save from this writer is over by then (the back-pressure wait comes first).
        return into.stage_in_background(state, record)

    def _record(self, started: tuple[float, float], staged: StagedSave) -> dict[str, Any]:
        """Record a finished copy for the save that carries it; returns the staged state."""
        started_wall, started_at = started
        self.slab = staged.slab
        self.pending = self.last = staged.pending  # the save's thread reports in through this
        waited = staged.waited
        # With overlap, the time until staging_completion: the most the trainer can have waited.
        stall = time.perf_counter() - started_at
        if waited > 0.01:
            logger.warning(
                "async save waited %.3f s for the previous save to tier %s to finish persisting"
                " (or for its spare buffer); save less often, or wait for the previous future",
                waited,
                self.tier_name,
            )
        self.report = RankReport(self.node, started_wall, stall, waited)
        return staged.state  # type: ignore[no-any-return]

    def register_thread(self, *, in_process: bool = True) -> None:
        """The thread carrying a staged save says so: the next stage() waits for it (``Pending``)."""
        if self.pending is not None:
            self.pending.register(threading.current_thread(), in_process=in_process)
            self.carried, self.pending = self.pending, None

    def settle(self) -> None:
        """This rank's part of the save it carries is done (see :meth:`Pending.settle`)."""
        carried, self.carried = self.carried, None
        if carried is not None:
            carried.settle()


def _stager_key(tier: Tier, tier_name: str) -> str:
    return f"{tier.root}|{tier_name}"


def stager_for_this_process(tier: Tier, tier_name: str) -> Stager:
    """The stager this process keeps for the tier (a forked child has its own)."""

    def directory() -> OwnedDirectory | None:
        if (local := tier.local) is None or not local.staging:
            return None  # anonymous shared memory, reused save after save
        return local.own_directory(writer_staging_dir(owner_dir_name()))

    return STAGERS.get().get(_stager_key(tier, tier_name), directory)


def wait_for_staging(tier: Tier, tier_name: str) -> None:
    """Wait for this process's overlapped staging into the tier, if it has a stager."""
    stager = STAGERS.get().peek(_stager_key(tier, tier_name))
    if stager is not None:
        stager.queue.wait_until_idle()


def release(tier: Tier, tier_name: str) -> None:
    """Release this process's staging buffers for the tier, once its staging is idle."""
    stager_for_this_process(tier, tier_name).wait_until_idle()
    stager = STAGERS.get().discard(_stager_key(tier, tier_name))
    if stager is not None:
        stager.close()
