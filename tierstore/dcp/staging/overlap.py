"""Overlapped staging: the copy into the slab runs on a background thread, one save after another.

With ``TieredWriter(..., overlap=True)``, ``stage()`` returns a :class:`StagingFuture` at once, and torch's
``dcp.async_save`` (2.13) then returns an ``AsyncSaveResponse``: ``staging_completion`` resolves when the
copy is done (the trainer may modify its tensors again), ``upload_completion`` when the checkpoint is
committed. DCP's background thread or process waits on the future before it plans the save.

Saves are staged strictly in the order their ``stage()`` calls were made (a :class:`StagingQueue` per
stager): each job starts only when the previous one has finished, so the back-pressure rule of
:mod:`tierstore.dcp.staging` (a save waits for the previous save from the same buffers) is applied on the
job's thread, never on the trainer's, and commits keep the order of the calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tierstore._platform.runtime import SerialWorker
from tierstore.errors import TierstoreError


class StagingFuture(Future[Any]):
    """The staged state dict, once copied; raises what the staging raised.

    torch 2.13's ``async_save`` asks ``done()`` once, right after starting the upload, and reports a
    staging future that is *already* done as a success, even when it failed (it never looks at the
    exception). A failure that lands before that check would otherwise resolve ``staging_completion``
    normally. So a failed future answers ``done() == False``: torch then attaches its callback, which
    runs at once and passes the exception on. ``result()``/``exception()`` are unaffected.
    (Pinned by ``tests/dcp/test_overlap_contract.py``.)
    """

    def done(self) -> bool:
        """True when the staging finished *successfully* or was cancelled (see the class doc)."""
        if not super().done():
            return False
        return self.cancelled() or self.exception(timeout=0) is None


class StagingQueue:
    """Runs staging jobs one at a time, in submission order, on one long-lived daemon thread (a
    :class:`~tierstore._platform.runtime.SerialWorker`: no thread start on the trainer's path).

    A daemon thread: a job blocked on a save that never ends must not hold the interpreter at
    exit. A job's failure is its future's; the next job runs regardless.
    """

    def __init__(self, name: str = "tierstore-stage") -> None:
        self._worker = SerialWorker(name)
        self._lock = threading.Lock()
        self._last: Future[None] | None = None
        """Resolved when the last job submitted has finished: jobs run in order, so then all have."""

    def submit(self, job: Callable[[], Any]) -> StagingFuture:
        """Run ``job`` after every job submitted before it has finished; returns its future."""
        future = StagingFuture()
        # Not the job's future: that one holds the staged state. The worker keeps nothing of a
        # job once it ran: a staged state (views into a slab) kept alive here would be unmapped
        # by whichever thread dropped it last, with the GIL held.
        finished: Future[None] = Future()

        def run() -> None:
            try:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    future.set_result(job())
                except Exception as exc:  # noqa: BLE001 - handed to the trainer through the future
                    future.set_exception(exc)
                except BaseException as exc:  # noqa: BLE001 - torch passes on only Exception
                    future.set_exception(TierstoreError(f"staging interrupted: {exc!r}"))
            finally:
                finished.set_result(None)

        with self._lock:  # recorded and queued together: the last recorded is the last to run
            self._last = finished
            self._worker.post(run)
        return future

    def wait_until_idle(self) -> None:
        """Block until every job submitted so far has finished (successfully or not).

        Every plain ``stage()`` calls this on the trainer's thread, nearly always with nothing
        queued: it then returns without waking the worker (a round trip through it cost 0.01-3 ms,
        more on a busy machine, inside the stall)."""
        with self._lock:
            last = self._last
        if last is not None and not last.done():
            self._worker.wait_idle()  # refused from a job of this queue: it would wait for itself

    def close(self) -> None:
        """Let the thread end once the jobs submitted so far have run (a later job starts another)."""
        self._worker.close()
