"""This process's background machinery, in one place: per-process state and serial workers.

tierstore keeps some state per process (stagers and their slabs, slab locks, copy helpers, S3
clients, the heartbeat of activity records, the peer mirror's workers, watchers of DCP's save
events) and runs background jobs on long-lived daemon threads: in order (:class:`SerialWorker`:
spare slabs, copy helpers, mirror rounds, a file's checksum beside its write) or on a beat
(:class:`Ticker`: the heartbeat), or fanned out for one call (:func:`map_on_daemons`: a
promoter's marker reads). A forked child (DCP's checkpoint process, a data-loader worker, a
trainer that forks) inherits that state but none of the threads, and may inherit a lock held by a
thread that does not exist there. So every such piece lives in a :class:`ProcessLocal`, a
:class:`SerialWorker` or a :class:`Ticker`, and this module's one fork hook gives the child fresh
ones: its own values, made on first use, and workers and tickers that start their own threads.

Torch-free: the promoter and the CLI use it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

from tierstore._platform import forks

T = TypeVar("T")
_Jobs = queue.SimpleQueue[tuple[Future[Any] | None, Callable[[], Any]] | None]
logger = logging.getLogger(__name__)


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
    are not run in the child. ``nice`` lowers the thread's scheduling priority (Linux: per thread),
    for work that must yield the CPU to the trainer.
    """

    def __init__(self, name: str, *, nice: int = 0) -> None:
        self.name = name
        self.nice = nice
        self._jobs: _Jobs | None = None
        """The running thread's queue (each thread has its own: see :meth:`close`)."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        track(self)

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Queue ``job``; returns its future at once."""
        future: Future[Any] = Future()
        self._put(future, job)
        return future

    def post(self, job: Callable[[], Any]) -> None:
        """Queue ``job`` without a future: for many small jobs (a checksum's chunks) whose outcome
        the caller learns otherwise, at a fraction of :meth:`submit`'s cost. An exception is logged
        (the next job runs regardless)."""
        self._put(None, job)

    def _put(self, future: Future[Any] | None, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._jobs is None:
                # A thread closed a moment ago may still run its last jobs: the new one waits for
                # it, so jobs never run side by side or out of order.
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._run, args=(self._jobs, self._thread, self.nice), name=self.name, daemon=True
                )
                self._thread.start()
            self._jobs.put((future, job))

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
    def _run(jobs: _Jobs, previous: threading.Thread | None, nice: int) -> None:
        if nice:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        if previous is not None:
            previous.join()
        while True:
            entry = jobs.get()
            if entry is None:
                return
            future, job = entry
            if future is None:
                try:
                    job()
                except BaseException:  # the next job runs regardless
                    logger.exception("%s: a background job failed", threading.current_thread().name)
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # noqa: BLE001 - the caller reads it from the future
                    future.set_exception(exc)
            del future, job, entry  # drop the job's references (slabs) before waiting again


class Ticker:
    """Calls ``tick`` every ``interval`` seconds on one daemon thread, from :meth:`start` (which
    may be called any number of times) until :meth:`close`.

    A tick that raises is logged and the beat goes on. Ticks never overlap: a beat started while
    a closed one still ticks waits for that tick. After a fork the child's ticker is stopped (the
    parent's thread does not exist there); :meth:`start` starts one of its own.
    """

    def __init__(self, name: str, interval: float, tick: Callable[[], None]) -> None:
        self.name = name
        self.interval = interval
        self._tick = tick
        self._stop: threading.Event | None = None
        """Set to end the running thread (each thread has its own: a closed one ends for good)."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        track(self)

    def start(self) -> None:
        """Start the beat if it is not running."""
        with self._lock:
            if self._stop is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop, self._thread), name=self.name, daemon=True
                )
                self._thread.start()

    def close(self) -> None:
        """End the beat (returns at once; a tick under way finishes)."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                self._stop = None

    def _forget_in_child(self) -> None:
        self._lock = threading.Lock()
        self._stop = None
        self._thread = None  # the parent's thread does not exist here: nothing to wait for

    def _run(self, stop: threading.Event, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()  # its tick under way ends first (its beat was closed)
        while not stop.wait(self.interval):
            try:
                self._tick()
            except Exception:
                logger.exception("%s: a tick failed", self.name)


K = TypeVar("K")


def map_on_daemons(items: list[K], job: Callable[[K], T], *, width: int, name: str) -> dict[K, T]:
    """``{item: job(item)}``, ``width`` items at a time on daemon threads that end with the call.

    For short fan-outs whose jobs may outlive their caller's interest (reads a hung store leaves
    pending once a deadline gave up on them): a pool's threads are joined at interpreter exit, and
    would hold it for the client's timeouts and retries; daemons do not. Whatever a job raises
    stops the others taking more and is raised here.
    """
    todo: queue.SimpleQueue[K] = queue.SimpleQueue()
    for item in items:
        todo.put(item)
    done: dict[K, T] = {}
    raised: list[BaseException] = []

    def work() -> None:
        while not raised:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done[item] = job(item)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
                raised.append(exc)

    workers = [
        threading.Thread(target=work, name=name, daemon=True) for _ in range(max(1, min(width, len(items))))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if raised:
        raise raised[0]
    return done


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
    forks.after_fork_in_child()  # first: no descriptor of the parent's stays open while others run
    for thing in list(_TRACKED):
        thing._forget_in_child()


# The package's one fork hook: the descriptor guard (forks.py) and every tracked per-process part.
os.register_at_fork(
    before=forks.before_fork, after_in_parent=forks.after_fork_in_parent, after_in_child=_after_fork_in_child
)
