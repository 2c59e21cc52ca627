"""The background worker behind spare slabs, unmapping and overlapped staging."""

from __future__ import annotations

import threading
import time

import pytest

from tierstore.dcp.worker import BackgroundWorker


def test_jobs_run_in_submission_order_on_one_thread() -> None:
    worker = BackgroundWorker("test-worker")
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
    worker = BackgroundWorker("test-worker")

    def fail() -> None:
        raise OSError("no room")

    failed = worker.submit(fail)
    after = worker.submit(lambda: 42)
    with pytest.raises(OSError, match="no room"):
        failed.result(timeout=10)
    assert after.result(timeout=10) == 42
    worker.close()


def test_close_ends_the_thread_after_queued_jobs_and_a_later_submit_starts_again() -> None:
    worker = BackgroundWorker("test-worker-close")
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
    worker = BackgroundWorker("test-worker-handover")
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
