"""When is a staged save over? The back-pressure rule between one save and the next.

A save that staged into a stager's buffers (see :mod:`tierstore.dcp.staging`) is over, and its
buffers and writer free for the next save, when **its owner says so**: whoever holds the save's
future (the :class:`~tierstore.dcp.manager.CheckpointManager`, through
``TieredWriter.over_when(future)``) calls :meth:`Pending.finish` when it is done. A bare
``dcp.async_save`` has no such owner in tierstore, and the save is inferred to be over when one of
these holds:

* **the thread carrying it has ended**: DCP's executor thread, in THREAD mode, or the thread that
  handed the writer to DCP's checkpoint process and waits for it, in PROCESS mode;
* **the thread carrying it has returned from DCP**: a save carried synchronously (``dcp.save`` of
  staged state on a long-lived worker thread) never ends its thread. DCP's own event for the end
  (or the exception) of that ``dcp.save`` call, reported on the carrier thread after its
  collectives (:mod:`tierstore.dcp.staging.save_events`), says the save has returned, committed
  or failed. Only for saves whose calls ran in this process: in PROCESS mode they run in DCP's
  checkpoint process, and the carrier only waits. Where those events do not reach tierstore
  (``logging.disable``, the deprecated ``dcp.save_state_dict``), the writer's word stands in:
  this rank's data written (:meth:`Pending.settle`), or its staged tensors freed;
* **it never reported in and nothing holds its staged tensors any more**: ``async_save`` failed
  between staging and handing the save over (PROCESS mode without a process group), so no thread
  can ever read them.

A staged state is good for saves until the next stage into the same buffers: a failed save retried
with it after that would write the later state's bytes, and is refused instead (see
:class:`~tierstore.errors.StaleStagedStateError`). Waiting for every reference to a failed save's
staged state to go away, to allow such retries, hung ordinary code: a saver thread's loop variable,
the caller's own name for it, or a failed future's traceback keep it alive indefinitely.

The carrier is only known once the save's first call on it reaches the writer (``reset``,
``storage_meta``, ``set_up_storage_writer``, or the pickling of the writer in PROCESS mode); a save
that does neither within :data:`REGISTRATION_TIMEOUT` is given up on, and its buffers are never
written again.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch

from tierstore.dcp.staging import save_events

logger = logging.getLogger(__name__)

REGISTRATION_TIMEOUT = 120.0
"""How long a staged save may take to reach tierstore's first call (PROCESS mode starts a process)."""
POLL_S = 0.1
"""How often a wait looks at the carrier (or at the staged tensors), between wake-ups."""
_COLLECT_AFTER_S = 1.0
"""An unreported save whose tensors are still alive after this long gets one garbage collection:
an exception's traceback cycle may be what holds them."""
_WARN_EVERY_S = 60.0


_warned = threading.Event()


def _warn_without_events() -> None:
    if not _warned.is_set():
        _warned.set()
        logger.warning(
            "DCP's save events do not reach tierstore (logging.disable, DCP's logger disabled, or"
            " the deprecated dcp.save_state_dict): a staged save carried by a thread that lives"
            " on counts as over once this rank's part is written; if it fails before that, the"
            " next stage waits for its staged state to be dropped"
        )


class Pending:
    """A save that staged into a stager's buffers, until it is over (see the module docstring)."""

    def __init__(self, staged: Iterable[torch.Tensor] = ()) -> None:
        self._registered = threading.Event()
        self._carrier: threading.Thread | None = None
        self._returned: threading.Event | None = None  # set when the carrier's dcp.save returns
        self._settled: threading.Event | None = None  # without DCP's events: the writer's word
        self._lock = threading.Lock()
        self._on_handover: list[Callable[[], None]] = []
        self._staged = [weakref.ref(tensor) for tensor in staged]
        self._collected = False
        self._over = threading.Event()

    def finish(self) -> None:
        """The save is over (committed or failed), in the word of the owner of its future: the
        explicit signal, before any of the inferences below."""
        self._over.set()

    def register(self, carrier: threading.Thread, *, in_process: bool) -> None:
        """Record the thread carrying the save (the first call wins) and run the handover jobs.

        ``in_process``: the save's DCP calls run on ``carrier`` in this process (not in DCP's
        checkpoint process), so its return from DCP ends the save.
        """
        with self._lock:
            if self._registered.is_set():
                return
            self._carrier = carrier
            # Watched from inside the save (this is its first call): its end cannot be missed.
            self._returned = save_events.watch() if in_process else None
            if in_process and self._returned is None:
                self._settled = threading.Event()
                _warn_without_events()
            self._registered.set()
            jobs, self._on_handover = self._on_handover, []
        for job in jobs:
            job()

    def settle(self) -> None:
        """The writer's word that this rank's part of the save is done (its data written, or the
        save failed in the writer): the save is over where DCP's events do not reach tierstore."""
        if self._settled is not None:
            self._settled.set()

    def on_handover(self, job: Callable[[], None]) -> None:
        """Run ``job`` once the save's thread has reported in (at once if it has): work that must
        stay out of the trainer's stall. A save that never reports in never runs it."""
        with self._lock:
            if not self._registered.is_set():
                self._on_handover.append(job)
                return
        job()

    def wait(self) -> bool:
        """Block until the save is over; False if it never reported in and may still run."""
        started = time.monotonic()
        if not self._wait_for_registration(started):
            return False
        carrier = self._carrier
        if self._over.is_set() or carrier is None or carrier is threading.current_thread():
            return True
        returned = self._returned or self._settled
        warned = time.monotonic()
        while (
            carrier.is_alive()
            and not self._over.is_set()
            and not (returned is not None and returned.is_set())
        ):
            if self._settled is not None and self._staged and self._all_freed():
                break  # no event will come; the save failed, and nothing can retry it
            if returned is not None:
                returned.wait(POLL_S)  # wakes at once when the save returns (or settles)
            elif isinstance(carrier, threading._DummyThread):
                time.sleep(POLL_S)  # not started by threading: it cannot be joined
            else:
                carrier.join(POLL_S)  # wakes at once when the thread ends
            if time.monotonic() - warned > _WARN_EVERY_S:
                warned = time.monotonic()
                logger.warning(
                    "still waiting (%.0f s) for the previous save, carried by thread %r, to end",
                    warned - started,
                    carrier.name,
                )
        if self._returned is not None and not self._returned.is_set():
            save_events.forget(carrier, self._returned)  # the thread ended first
        return True

    def _wait_for_registration(self, started: float) -> bool:
        """True once the save reported in, or once nothing can read its staged tensors."""
        while not self._registered.is_set() and not self._over.is_set():
            if self._abandoned(started):
                logger.info("the previous save failed before it was handed over")
                return True
            if self._registered.wait(POLL_S):
                break
            if time.monotonic() - started > REGISTRATION_TIMEOUT:
                return False
        return True

    def _abandoned(self, started: float) -> bool:
        """Every staged tensor has been freed (a state without tensors tells nothing). After
        :data:`_COLLECT_AFTER_S`, one garbage collection first: a failed save's traceback cycle
        may be what holds them."""
        if not self._staged:
            return False
        if not self._collected and time.monotonic() - started > _COLLECT_AFTER_S:
            self._collected = True
            gc.collect()
        return self._all_freed()

    def _all_freed(self) -> bool:
        return all(ref() is None for ref in self._staged)
