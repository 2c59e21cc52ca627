"""The runtime's serial worker (spare slabs, unmapping, overlapped staging) and per-process state."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest

from tests.forked import in_forked_child
from tierstore.runtime import ProcessLocal, SerialWorker


def test_jobs_run_in_submission_order_on_one_thread() -> None:
    worker = SerialWorker("test-worker")
    gate = threading.Event()
    seen: list[tuple[int, int]] = []
    first = worker.submit(gate.wait)  # holds the thread until released
    futures = [
        worker.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(20)
    ]
    assert not seen, "no job overtook the one still running"
    gate.set()
    for future in [first, *futures]:
        future.result(timeout=10)
    assert [i for i, _ in seen] == list(range(20))
    assert len({ident for _, ident in seen}) == 1, "one thread ran every job"
    worker.close()


def test_a_failed_job_fails_its_future_and_the_next_job_still_runs() -> None:
    worker = SerialWorker("test-worker")

    def fail() -> None:
        raise OSError("no room")

    failed = worker.submit(fail)
    after = worker.submit(lambda: 42)
    with pytest.raises(OSError, match="no room"):
        failed.result(timeout=10)
    assert after.result(timeout=10) == 42
    worker.close()


def test_close_ends_the_thread_after_queued_jobs_and_a_later_submit_starts_again() -> None:
    worker = SerialWorker("test-worker-close")
    slow = worker.submit(lambda: time.sleep(0.2) or "done")
    worker.close()
    assert slow.result(timeout=10) == "done", "jobs queued before close() still run"
    deadline = time.monotonic() + 10
    while any(t.name == "test-worker-close" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the worker thread did not end after close()"
        time.sleep(0.01)
    assert worker.submit(lambda: "again").result(timeout=10) == "again"
    worker.close()


def test_jobs_submitted_after_close_wait_for_the_closed_threads_jobs() -> None:
    # Writers share a stager: one may close it while another still submits to it.
    worker = SerialWorker("test-worker-handover")
    gate = threading.Event()
    order: list[str] = []
    before = worker.submit(lambda: (gate.wait(10), order.append("before close")))
    worker.close()
    after = worker.submit(lambda: order.append("after close"))
    time.sleep(0.2)
    assert order == [], "a job submitted after close() ran beside the closed thread's job"
    gate.set()
    before.result(timeout=10)
    after.result(timeout=10)
    assert order == ["before close", "after close"]
    worker.close()


def test_wait_idle_returns_once_the_jobs_submitted_so_far_have_run() -> None:
    worker = SerialWorker("test-worker-idle")
    gate = threading.Event()
    worker.submit(gate.wait)
    assert not worker.wait_idle(timeout=0.2), "idle while a job still runs"
    gate.set()
    assert worker.wait_idle(timeout=10)
    worker.close()


def test_a_forked_child_gets_fresh_state_and_a_worker_thread_of_its_own() -> None:
    """The parent's worker is busy (its job holds the thread) and its lock is held at the fork,
    as a parent thread may hold it: the child's worker and values must not wait for either, and
    the parent's values must not be collected in the child (their finalizers would run there)."""
    made: list[int] = []
    finalized: list[int] = []

    class Value:
        """A made value whose collection is recorded (as a stager's finalizer removes files)."""

        def __init__(self, number: int) -> None:
            self.number = number

    def make() -> Value:
        made.append(os.getpid())
        value = Value(len(made))
        weakref.finalize(value, finalized.append, os.getpid())
        return value

    local = ProcessLocal(make)
    assert local.get().number == 1
    worker = SerialWorker("test-worker-fork")
    gate = threading.Event()
    worker.submit(gate.wait)

    def child() -> int:
        fresh = local.get().number == 2 and made[-1] == os.getpid()
        gc.collect()
        if finalized:  # the parent's value was collected here: its finalizer ran in the child
            return 4
        ran = worker.submit(os.getpid).result(timeout=10) == os.getpid()
        return 0 if fresh and ran else 3

    try:
        with worker._lock:  # held by a parent thread at the moment of the fork
            status = in_forked_child(child, deadline=30)
    finally:
        gate.set()
        worker.close()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert local.get().number == 1, "the parent keeps its own value"


def test_wait_idle_from_the_workers_own_job_is_refused_not_a_deadlock() -> None:
    worker = SerialWorker("test-worker-self")
    inner = worker.submit(worker.wait_idle)
    with pytest.raises(RuntimeError, match="own job"):
        inner.result(timeout=10)
    assert worker.wait_idle(timeout=10)
    worker.close()
