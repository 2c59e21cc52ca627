"""This process's background machinery, in one place: per-process state and serial workers.

tierstore keeps some state per process (stagers and their slabs, slab locks, copy helpers, S3
clients, the heartbeat of activity records, watchers of DCP's save events) and runs background jobs
on long-lived daemon threads. A forked child (DCP's checkpoint process, a data-loader worker, a
trainer that forks) inherits that state but none of the threads, and may inherit a lock held by a
thread that does not exist there. So every such piece lives in a :class:`ProcessLocal` or a
:class:`SerialWorker`, and this module's one fork hook gives the child fresh ones: its own values,
made on first use, and workers that start their own threads.

Torch-free: the promoter and the CLI use it too.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
_Jobs = queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]


class ProcessLocal(Generic[T]):
    """A value of this process, made by ``factory`` on first use; a forked child makes its own."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._value: T | None = None
        self._lock = threading.Lock()
        track(self)

    def get(self) -> T:
        """This process's value (made now if this process has none yet)."""
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def _forget_in_child(self) -> None:
        self._lock = threading.Lock()  # may have been held by a parent thread at the fork
        if self._value is not None:
            # Collecting the parent's objects here would run their finalizers in the child (a
            # stager's removes the parent's staging files).
            keep_inherited(self._value)
        self._value = None


class SerialWorker:
    """Runs jobs one at a time, in submission order, on one daemon thread started on first use.

    A daemon thread, so that a job still running (a spare slab being populated) cannot hold the
    interpreter at exit. A job's exception goes to its future; the next job runs regardless. After
    a fork, the child's worker starts a thread of its own on its first job; jobs the parent queued
    are not run in the child.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: _Jobs | None = None
        """The running thread's queue (each thread has its own: see :meth:`close`)."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        track(self)

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Queue ``job``; returns its future at once."""
        future: Future[Any] = Future()
        with self._lock:
            if self._jobs is None:
                # A thread closed a moment ago may still run its last jobs: the new one waits for
                # it, so jobs never run side by side or out of order.
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._run, args=(self._jobs, self._thread), name=self.name, daemon=True
                )
                self._thread.start()
            self._jobs.put((future, job))
        return future

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False if ``timeout`` passed first.

        Not from one of this worker's own jobs: that job would wait for itself."""
        if self._thread is not None and self._thread is threading.current_thread():
            raise RuntimeError(f"{self.name}: wait_idle() from the worker's own job waits forever")
        try:
            self.submit(lambda: None).result(timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Let the thread end once the jobs queued so far have run (returns at once)."""
        with self._lock:
            if self._jobs is not None:
                self._jobs.put(None)
                self._jobs = None

    def _forget_in_child(self) -> None:
        self._lock = threading.Lock()
        self._jobs = None
        self._thread = None  # the parent's thread does not exist here: nothing to wait for

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


class ForkAware(Protocol):
    """Something with per-process parts that a forked child must replace."""

    def _forget_in_child(self) -> None:
        """Replace the per-process parts, in a forked child, before any other code runs there."""


_TRACKED: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_INHERITED: list[Any] = []
"""A forked child's copies of its parent's per-process objects: kept, never used nor closed."""


def track(thing: ForkAware) -> None:
    """Have ``thing._forget_in_child()`` called in every forked child while ``thing`` lives."""
    _TRACKED.add(thing)


def keep_inherited(thing: object) -> None:
    """In a forked child: keep the parent's ``thing`` alive, unused. Closing or collecting it could
    run the parent's teardown here (a finalizer removing its files, an s3fs session's loop)."""
    _INHERITED.append(thing)


def finalize(owner: object, cleanup: Callable[..., Any], *args: Any) -> weakref.finalize[Any, Any]:
    """``weakref.finalize(owner, cleanup, *args)`` for this process only. A forked child inherits
    the registration, and runs it when ``owner`` dies there or at its exit: a child that exits
    normally would remove the parent's staging files or end its in-flight records. In any process
    but this one the call does nothing."""
    return weakref.finalize(owner, _in_process, os.getpid(), cleanup, *args)


def _in_process(pid: int, cleanup: Callable[..., Any], *args: Any) -> None:
    if os.getpid() == pid:
        cleanup(*args)


def _after_fork_in_child() -> None:
    for thing in list(_TRACKED):
        thing._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
