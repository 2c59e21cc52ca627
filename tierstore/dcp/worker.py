"""One long-lived background thread per stager, for the housekeeping around a save's copy.

After every ``async_save`` the stager retires the slab the last save consumed and prepares a spare for
the next one. Starting a thread for each of those costs the trainer a few milliseconds per save on a
busy 2-core machine (``Thread.start`` waits until the new thread has taken the GIL once); handing the
job to a thread that already runs does not wait at all.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Jobs = queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]


class BackgroundWorker:
    """Runs jobs one at a time, in submission order, on one daemon thread started on first use.

    A daemon thread, so that a job still running (a spare being populated) cannot hold the
    interpreter at exit. A job's exception goes to its future; the next job runs regardless.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: _Jobs | None = None
        """The running thread's queue (each thread has its own: see :meth:`close`)."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Queue ``job``; returns its future at once."""
        future: Future[Any] = Future()
        with self._lock:
            if self._jobs is None:
                # A thread closed a moment ago may still run its last jobs: the new one waits for
                # it, so jobs never run side by side or out of order.
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._run, args=(self._jobs, self._thread), name=self._name, daemon=True
                )
                self._thread.start()
            self._jobs.put((future, job))
        return future

    def close(self) -> None:
        """Let the thread end once the jobs queued so far have run (returns at once)."""
        with self._lock:
            if self._jobs is not None:
                self._jobs.put(None)
                self._jobs = None

    @staticmethod
    def _run(jobs: _Jobs, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        while True:
            entry = jobs.get()
            if entry is None:
                return
            future, job = entry
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - the job's caller reads it from the future
                future.set_exception(exc)
            del future, job, entry  # drop the job's references (slabs) before waiting again
