"""The checkpoint loop of a training job, owned once: when to save, resuming, pre-emption, a durable end.

::

    manager = CheckpointManager(cfg, {"train": state}, every_steps=100)
    step = manager.restore() or 0              # the newest committed checkpoint, on every rank
    while step < total and not manager.should_stop:
        step += 1
        train_step(state)
        manager.maybe_save(step)               # when due, or at once after SIGTERM/SIGUSR1
    manager.close(step)                        # the last state saved, durable in the last tier

A save is due every ``every_steps`` steps, every ``every_seconds`` seconds, or at Daly's interval from
the measured stalls (``mtbf``, :mod:`tierstore.interval`), whichever comes first; the ranks agree on it
(one small all-reduce on the manager's own gloo group), so every rank saves the same step. Pre-emption,
the durable end and every argument: docs/usage.md, "CheckpointManager".
"""

from __future__ import annotations

import logging
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tierstore.config import Config, as_config
from tierstore.dcp.restore import TieredReader
from tierstore.dcp.save import TieredWriter
from tierstore.dcp.tools import latest_committed
from tierstore.errors import ConfigError, TierstoreError
from tierstore.ids import validate_checkpoint_id
from tierstore.interval import daly
from tierstore.records.marker import read_manifest

logger = logging.getLogger(__name__)
STEP_KEY = "tierstore_manager"
"""Where the manager keeps the step in the checkpoint, beside the caller's state."""


def default_id(step: int) -> str:
    """``step_00000042``: zero-padded, so ids sort by step where people read them."""
    return f"step_{step:08d}"


class CheckpointManager:
    """See the module docstring. Every rank of the job constructs it (collective), in the same order
    as its other process groups; ``writer_options`` go to :class:`TieredWriter` (``overwrite``,
    ``check_finite``, ``commit_gate``, ``overlap``). ``stop_requested``: the caller's own record of a
    stop signal (one noted before the manager existed), instead of the manager's handlers.
    ``on_saved(checkpoint_id, error)``: told of each save's outcome; a failure it is told of is not
    raised (a periodic save the caller can live without)."""

    def __init__(
        self,
        config: Config | str,
        state: dict[str, Any],
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        mtbf: float | None = None,
        checkpoint_id: Callable[[int], str] = default_id,
        async_mode: str | None = "thread",
        stop_signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
        load_planner: LoadPlanner | None = None,
        stop_requested: Callable[[], bool] | None = None,
        on_saved: Callable[[str, BaseException | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        **writer_options: Any,
    ) -> None:
        if every_steps is None and every_seconds is None and mtbf is None:
            raise ConfigError("CheckpointManager: give every_steps, every_seconds or mtbf (when to save)")
        if every_steps is not None and (type(every_steps) is not int or every_steps < 1):
            raise ConfigError(f"CheckpointManager: every_steps {every_steps!r}: expected an int >= 1")
        for name, seconds in (("every_seconds", every_seconds), ("mtbf", mtbf)):
            if seconds is not None and not (
                isinstance(seconds, int | float) and not isinstance(seconds, bool) and 0 < seconds < math.inf
            ):
                raise ConfigError(f"CheckpointManager: {name} {seconds!r}: expected seconds > 0")
        if not callable(checkpoint_id):
            raise ConfigError(f"CheckpointManager: checkpoint_id {checkpoint_id!r}: expected step -> id")
        if async_mode not in ("thread", "process", None):
            raise ConfigError(
                f"CheckpointManager: async_mode {async_mode!r}: expected 'thread', 'process' or None"
            )
        distributed = dist.is_available() and dist.is_initialized()
        if async_mode == "process" and not distributed:
            raise ConfigError(
                "CheckpointManager: async_mode 'process' needs torch.distributed initialised "
                "(DCP's checkpoint process joins the job's ranks); use 'thread' in a single process"
            )
        self.config, self.state = as_config(config), state
        self.every_steps, self.every_seconds, self.mtbf = every_steps, every_seconds, mtbf
        self.checkpoint_id, self.async_mode = checkpoint_id, async_mode
        self.load_planner, self.clock, self.on_saved = load_planner, clock, on_saved
        self.writer = TieredWriter(self.config, **writer_options)
        self._options = writer_options
        # The save's collectives run off the training group: on it they would interleave with the
        # training's own (DDP's all-reduces) from another thread. The agreement runs on a group of
        # its own, for the same reason: an async save's collectives are still running on ``group``.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._agreement = dist.new_group(backend="gloo") if distributed else None
        self._pending: tuple[str, Future[Any]] | None = None
        self._closed = False
        self._last_save = clock()
        self._stalls: list[float] = []
        self._received: list[int] = []
        self.should_stop = False
        """True once a stop signal was agreed: the save at that step is committed; leave the loop."""
        self.last_saved: str | None = None
        self.restored_from: tuple[str, str] | None = None
        """``(checkpoint id, tier)`` of the last :meth:`restore`."""
        self._stop_requested = stop_requested or (lambda: bool(self._received))
        try:
            self._install(() if stop_requested else stop_signals)
        except BaseException:
            self._destroy_groups()
            raise

    # -- resuming ------------------------------------------------------------------------------

    def restore(self, checkpoint_id: str | None = None) -> int | None:
        """Load ``checkpoint_id`` (default: the newest this job can restore) into the state, on
        every rank; the step it was saved at, or None when there is nothing to restore."""
        self._check_open("restore")
        chosen = checkpoint_id or latest_committed(self.config)
        if chosen is None:
            return None
        step: dict[str, Any] = {"step": None}  # None until loaded: a checkpoint may hold no step
        started = time.monotonic()
        reader = TieredReader(self.config)
        dcp.load(
            {**self.state, STEP_KEY: step},
            storage_reader=reader,
            checkpoint_id=chosen,
            planner=self.load_planner,
            process_group=self.group,
        )
        if type(step["step"]) is not int:  # a planner allowing a partial load left it unset
            raise TierstoreError(
                f"{chosen} holds no step ({STEP_KEY}): not saved by CheckpointManager; its state was "
                "loaded, its step is not known (load it with dcp.load and TieredReader instead)"
            )
        if self.group is None or dist.get_rank(self.group) == 0:
            took = time.monotonic() - started
            logger.info(
                "resumed from %s (step %d), tier %s, in %.2f s",
                chosen,
                step["step"],
                reader.chosen_tier,
                took,
            )
        self.last_saved, self.restored_from = chosen, (chosen, reader.chosen_tier or "-")
        return step["step"]

    # -- saving --------------------------------------------------------------------------------

    @property
    def interval(self) -> float | None:
        """Seconds between saves: Daly's from the measured stalls (with ``mtbf``) or ``every_seconds``,
        the shorter of the two given."""
        if self.mtbf is None or not self._stalls:
            return self.every_seconds
        measured = daly(max(statistics.median(self._stalls), 1e-6), self.mtbf)
        return measured if self.every_seconds is None else min(measured, self.every_seconds)

    def maybe_save(self, step: int, *, force: bool = False) -> bool:
        """Save at ``step`` if due (see the module docstring) or ``force``; True if a save began. On
        every rank, at every step (the ranks agree here)."""
        self._check_open("maybe_save")
        due = force or self._due(step)
        stop = self._stop_requested()
        due, stop = self._agree(due, stop)
        if stop and not self.should_stop:
            logger.warning("stop signal received: saving step %d, then stopping", step)
            self.should_stop = True
            self._after_the_save_in_flight(lambda: self._save(step, synchronous=True))
            return True
        if due:
            self._save(step, synchronous=self.async_mode is None)
        return due

    def wait(self) -> None:
        """Until the save in flight has committed; its failure is raised here."""
        if self._pending is None:
            return
        checkpoint, future = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if self.on_saved is None or isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self.on_saved(checkpoint, exc)
            return
        self.last_saved = checkpoint
        if self.on_saved is not None:
            self.on_saved(checkpoint, None)

    def close(self, step: int | None = None, *, durable: bool = True) -> None:
        """Wait for the save in flight; with ``step``, save the state as of ``step`` unless its save
        has committed (synchronously; ``durable``: straight into the last tier, see
        :meth:`save_durable`, even when a faster tier holds it). Ends the writer, the handlers and
        the manager's two process groups. Again, without ``step``: nothing to do."""
        if self._closed and step is None:
            return
        self._check_open("close(step)")

        def last_save() -> None:
            if step is not None and durable:
                self.save_durable(step)
            elif step is not None and self.last_saved != self.checkpoint_id(step):
                self._save(step, synchronous=True)

        try:
            self._after_the_save_in_flight(last_save)
        finally:
            self._closed = True
            self.writer.close()
            self._uninstall()
            self._destroy_groups()

    def _after_the_save_in_flight(self, last_save: Callable[[], None]) -> None:
        """Wait for the save in flight, then make ``last_save`` (the stop save, close's) even if the
        one in flight failed: that failure is raised after it, not instead of it."""
        earlier: BaseException | None = None
        try:
            self.wait()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - raised below, once the last state is saved
            earlier = exc
        try:
            last_save()
        except BaseException as exc:
            if earlier is not None:
                raise exc from earlier
            raise
        if earlier is not None:
            raise earlier

    def _destroy_groups(self) -> None:
        """The two gloo groups the manager made (their sockets and threads, on every rank)."""
        groups, self.group, self._agreement = (self.group, self._agreement), None, None
        for group in groups:
            if group is not None and dist.is_initialized():  # not after the job destroyed them all
                dist.destroy_process_group(group)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TierstoreError(f"CheckpointManager: {what} after close(): the manager is closed")

    def _due(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.mtbf is not None and not self._stalls:
            return True  # nothing measured yet: the first save measures the stall
        interval = self.interval
        return interval is not None and self.clock() - self._last_save >= interval

    def _agree(self, due: bool, stop: bool) -> tuple[bool, bool]:
        """Any rank's reason is every rank's (a MAX all-reduce on the agreement's own group)."""
        if self._agreement is None:
            return due, stop
        flags = torch.tensor([int(due), int(stop)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._agreement)
        return bool(flags[0]), bool(flags[1])

    def _save(self, step: int, *, synchronous: bool, writer: TieredWriter | None = None) -> None:
        self.wait()  # one save in flight: its failure surfaces before the next begins
        # An id no tier accepts is the caller's bug, on every rank alike: raised, never told.
        checkpoint = validate_checkpoint_id(self.checkpoint_id(step))
        state = {**self.state, STEP_KEY: {"step": step}}
        started = time.perf_counter()
        future: Future[Any] = Future()
        if synchronous:
            try:
                dcp.save(
                    state,
                    storage_writer=writer or self.writer,
                    checkpoint_id=checkpoint,
                    process_group=self.group,
                )
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - told, or raised, by wait() as an async failure
                future.set_exception(exc)
        else:
            thread, process = AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS
            started_save = dcp.async_save(
                state,
                storage_writer=self.writer,
                checkpoint_id=checkpoint,
                process_group=self.group,
                async_checkpointer_type=process if self.async_mode == "process" else thread,
            )
            if isinstance(started_save, AsyncSaveResponse):
                # An overlapped writer copies the state in the background; the trainer modifies it
                # once maybe_save returns, so the copy must be done by then (a failed copy fails
                # the upload too: raised, or told, by wait()).
                wait_for([started_save.staging_completion])
                started_save = started_save.upload_completion
            future = started_save
            self.writer.over_when(future)  # back-pressure from the future, not inferred
        self._pending = (checkpoint, future)
        if writer is None and synchronous == (self.async_mode is None):  # a save as the periodic ones
            self._stalls.append(time.perf_counter() - started)
            del self._stalls[:-8]  # the median of the last few
        self._last_save = self.clock()
        if synchronous:
            self.wait()

    def save_durable(self, step: int) -> None:
        """Save the state as of ``step`` straight into the last tier (replacing a copy of that id
        elsewhere: it becomes the newest commit) and confirm its marker there; synchronous."""
        self._check_open("save_durable")
        last = self.config.tiers[-1].name
        options = {**self._options, "overwrite": True, "overlap": False}
        durable = TieredWriter(self.config, tier=last, **options)
        try:
            self._save(step, synchronous=True, writer=durable)
        finally:
            durable.close()
        checkpoint = self.checkpoint_id(step)
        # A failure told to on_saved returned here: the marker decides, and every rank hears it.
        problem: BaseException | None = None
        if self.group is None or dist.get_rank(self.group) == 0:
            tier = self.config.make_tier(last, node=self.writer.node)
            try:
                read_manifest(tier, checkpoint, trust=self.config.marker_trust())  # raises if absent
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                problem = exc
        _, absent = self._agree(False, problem is not None)
        if absent:
            why = f"{type(problem).__name__}: {problem}" if problem is not None else "rank 0 found none"
            raise TierstoreError(
                f"{checkpoint} is not durable: no valid commit marker in tier {last} ({why})"
            ) from problem
        logger.info("%s is durable in tier %s", checkpoint, last)

    # -- signals -------------------------------------------------------------------------------

    def _install(self, signals: Sequence[int]) -> None:
        self._previous: Mapping[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            if signals:
                logger.warning("CheckpointManager made off the main thread: stop signals are not watched")
            return
        previous: dict[int, Any] = {}
        try:
            for number in signals:
                previous[number] = signal.signal(number, self._on_signal)
        except BaseException:  # one that cannot be caught (SIGKILL): none of them stays installed
            for number, handler in previous.items():
                signal.signal(number, handler)
            raise
        self._previous = previous

    def _uninstall(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _on_signal(self, number: int, _frame: object) -> None:
        self._received.append(number)  # acted on at the next maybe_save, on every rank


__all__ = ["STEP_KEY", "CheckpointManager", "default_id"]
