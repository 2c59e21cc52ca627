"""The runtime's serial worker (spare slabs, unmapping, overlapped staging, mirror rounds, checksums),
its ticker (the heartbeat) and per-process state."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest

from tests.forked import in_forked_child
from tierstore._platform.runtime import ProcessLocal, SerialWorker, Ticker, map_on_daemons


def test_jobs_run_in_submission_order_on_one_thread() -> None:
    worker = SerialWorker("test-worker")
    gate = threading.Event()
    seen: list[tuple[int, int]] = []
    first = worker.submit(gate.wait)  # holds the thread until released
    futures = [worker.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(20)]
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


def test_posted_jobs_run_in_order_with_submitted_ones_and_a_failure_is_logged_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``post`` (no future: a checksum's many chunks, a mirror round) shares the one queue."""
    worker = SerialWorker("test-worker-post")
    order: list[str] = []

    def fail() -> None:
        raise KeyboardInterrupt  # not even a BaseException may end the worker's thread

    worker.post(lambda: order.append("posted"))
    worker.post(fail)
    last = worker.submit(lambda: order.append("submitted"))
    last.result(timeout=10)
    assert order == ["posted", "submitted"]
    assert "test-worker-post: a background job failed" in caplog.text
    worker.close()


def test_a_low_priority_worker_runs_its_jobs_at_that_nice_value() -> None:
    worker = SerialWorker("test-worker-nice", nice=5)
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    there = worker.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(
        timeout=10
    )
    assert there == min(19, here + 5), "the mirror's rounds must yield the CPU to the trainer"
    worker.close()


def _beats(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def test_a_ticker_beats_until_closed_and_a_failing_tick_does_not_stop_it() -> None:
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 2:
            raise OSError("the tier is briefly unreachable")

    ticker = Ticker("test-ticker", 0.02, tick)
    assert not ticks and _beats("test-ticker") == 0, "nothing beats before start()"
    ticker.start()
    ticker.start()  # idempotent: still one thread
    deadline = time.monotonic() + 10
    while len(ticks) < 5:
        assert time.monotonic() < deadline, "the beat stopped (after the failing tick?)"
        time.sleep(0.01)
    assert _beats("test-ticker") == 1
    ticker.close()
    while _beats("test-ticker"):
        assert time.monotonic() < deadline, "the ticker's thread did not end after close()"
        time.sleep(0.01)
    count = len(ticks)
    time.sleep(0.1)
    assert len(ticks) == count, "a closed ticker ticked"
    ticker.start()  # a later start beats again
    while len(ticks) == count:
        assert time.monotonic() < deadline, "start() after close() did not beat again"
        time.sleep(0.01)
    ticker.close()


def test_a_forked_childs_ticker_is_stopped_until_it_starts_one_of_its_own() -> None:
    """The parent's beat (a thread) does not exist in the child, and its lock may be held there:
    the child's start() must start a thread of its own, not believe the parent's is running."""
    ticks: list[int] = []
    ticker = Ticker("test-ticker-fork", 0.02, lambda: ticks.append(os.getpid()))
    ticker.start()

    def child() -> int:
        ticks.clear()
        time.sleep(0.2)
        if ticks:
            return 3  # something ticked in the child before it started its own beat
        ticker.start()
        deadline = time.monotonic() + 10
        while not ticks:
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.01)
        return 0 if set(ticks) == {os.getpid()} else 5

    try:
        with ticker._lock:  # held by a parent thread at the moment of the fork
            status = in_forked_child(child, deadline=30)
    finally:
        ticker.close()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_ticker_started_again_while_its_closed_beat_ticks_never_ticks_twice_at_once() -> None:
    """close() returns while a tick is under way; a start() right after must not tick beside it
    (two heartbeat refreshes of one record racing, say): the new beat waits for the old one."""
    lock = threading.Lock()
    running: list[int] = []
    most = 0
    ticked = threading.Event()

    def tick() -> None:
        nonlocal most
        with lock:
            running.append(1)
            most = max(most, len(running))
        ticked.set()
        time.sleep(0.2)
        with lock:
            running.pop()

    ticker = Ticker("test-ticker-restart", 0.01, tick)
    ticker.start()
    assert ticked.wait(10)  # a tick is under way now
    ticker.close()
    ticker.start()
    time.sleep(0.35)  # the old tick ends at 0.2 s; the new beat's first at about 0.21 s
    ticker.close()
    assert most == 1, f"{most} ticks ran at once"


def test_map_on_daemons_maps_every_item_on_daemon_threads_and_raises_a_jobs_error() -> None:
    seen: set[bool] = set()

    def square(item: int) -> int:
        seen.add(threading.current_thread().daemon)
        return item * item

    assert map_on_daemons(list(range(40)), square, width=8, name="t") == {i: i * i for i in range(40)}
    assert seen == {True}, "daemons: a job still pending at exit does not hold it"

    def fails(item: int) -> int:
        if item == 3:
            raise KeyboardInterrupt("stop")
        return item

    with pytest.raises(KeyboardInterrupt, match="stop"):
        map_on_daemons(list(range(10)), fails, width=4, name="t")
