"""When a staged save is over: the next stage() waits exactly as long as the previous save can still
read its buffers or use the writer, and no longer (see tierstore.dcp.pending)."""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tests.dcp.test_staging import assert_loaded, model_state, tier0
from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.dcp import pending as pending_module
from tierstore.dcp.gate import GateView
from tierstore.dcp.pending import Pending
from tierstore.manifest import read_manifest


class SyncSaver:
    """A long-lived worker thread that runs synchronous ``dcp.save`` calls of staged states."""

    def __init__(self, writer: TieredWriter) -> None:
        self.writer = writer
        self.jobs: queue.Queue[tuple[Any, str] | None] = queue.Queue()
        self.done: queue.Queue[tuple[str, float]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="sync-saver")
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            staged, checkpoint_id = job
            dcp.save(staged, storage_writer=self.writer, checkpoint_id=checkpoint_id)
            self.done.put((checkpoint_id, time.perf_counter()))
            del staged, job  # the staged state lives on in the caller's thread, as in a trainer

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(10)


def stage_in_thread(writer: TieredWriter, state: Any, deadline: float) -> tuple[Any, float]:
    """``writer.stage(state)`` on a thread of its own; the staged state and when stage returned.
    Fails the test (instead of hanging it) if stage has not returned within ``deadline`` s."""
    out: list[Any] = []
    thread = threading.Thread(
        target=lambda: out.append((writer.stage(state), time.perf_counter())), daemon=True
    )
    thread.start()
    thread.join(deadline)
    assert out, f"stage() did not return within {deadline} s: it waits for a save that is over"
    staged, returned = out[0]
    return staged, returned


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_saves_carried_by_a_long_lived_thread_do_not_hold_up_the_next_stage(
    make_config: Callable[..., Config], kind: str
) -> None:
    """stage() on one thread, a synchronous dcp.save of the staged state on a worker thread that
    lives on: the next stage used to wait for that thread to end, which never happens."""
    config = make_config(kind)
    writer = TieredWriter(config)
    saver = SyncSaver(writer)
    try:
        for index in range(3):
            staged, _ = stage_in_thread(writer, model_state(index), deadline=30)
            saver.jobs.put((staged, f"step_{index}"))
            assert saver.done.get(timeout=30)[0] == f"step_{index}"
    finally:
        saver.stop()
    for index in range(3):
        assert_loaded(config, f"step_{index}", model_state(index))


def test_the_next_stage_still_waits_while_a_synchronous_save_runs(
    make_config: Callable[..., Config],
) -> None:
    """The other half of the rule: while the long-lived thread is still inside DCP's save (here, in
    a slow commit gate), the next stage must not copy into the buffers it is writing."""
    config = make_config("local")  # the one staging buffer is reused: a copy into it too early
    in_gate = threading.Event()  # would change the save still being written

    def slow(view: GateView) -> None:
        in_gate.set()
        time.sleep(1.0)

    writer = TieredWriter(config, commit_gate=slow)
    saver = SyncSaver(writer)
    try:
        staged, _ = stage_in_thread(writer, model_state(1), deadline=30)
        saver.jobs.put((staged, "step_1"))
        assert in_gate.wait(30)
        _, staged_again = stage_in_thread(writer, model_state(2), deadline=30)
        saved, returned = saver.done.get(timeout=30)
    finally:
        saver.stop()
    assert saved == "step_1"
    assert staged_again >= returned, "the next stage copied while the previous save was running"
    assert_loaded(config, "step_1", model_state(1))


def test_a_save_that_fails_before_its_handover_does_not_hold_up_the_next(
    make_config: Callable[..., Config],
) -> None:
    """PROCESS mode without a process group: async_save raises after stage(), and nothing ever
    carries the save. The next save used to wait REGISTRATION_TIMEOUT (120 s) for it."""
    config = make_config("memory")
    writer = TieredWriter(config)
    with pytest.raises(ValueError, match="process group"):
        dcp.async_save(
            model_state(1), storage_writer=writer, checkpoint_id="step_1",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )  # fmt: skip
    started = time.perf_counter()
    dcp.async_save(model_state(2), storage_writer=writer, checkpoint_id="step_2").result()
    assert time.perf_counter() - started < 10
    wait_s = read_manifest(tier0(config), "step_2").timings["wait_s"]
    assert wait_s is not None and wait_s < 5, f"waited {wait_s} s for a save nobody carries"
    assert_loaded(config, "step_2", model_state(2))


def test_an_unreported_save_whose_tensors_are_alive_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Someone still holds the staged tensors: the save may yet start, so the wait goes on until
    the registration timeout, and then reports that the buffers are still in use."""
    monkeypatch.setattr(pending_module, "REGISTRATION_TIMEOUT", 0.5)
    staged = [torch.zeros(4)]
    started = time.perf_counter()
    assert Pending(staged).wait() is False
    assert time.perf_counter() - started >= 0.5
    assert Pending().wait() is False, "a state without tensors tells nothing: wait it out"


def test_an_unreported_save_is_over_once_its_tensors_are_freed() -> None:
    staged = [torch.zeros(4), torch.ones(3)]
    pending = Pending(staged)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(pending.wait()), daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive(), "over while the staged tensors were still held"
    del staged
    gc.collect()
    waiter.join(5)
    assert result == [True]


def test_a_save_carried_by_another_process_is_over_only_when_its_thread_ends() -> None:
    """PROCESS mode: the carrier only waits for DCP's checkpoint process, outside DCP's code; its
    stack says nothing, so only its end counts."""
    release = threading.Event()
    carrier = threading.Thread(target=release.wait, daemon=True)
    carrier.start()
    pending = Pending([torch.zeros(1)])
    pending.register(carrier, in_process=False)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(pending.wait()), daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert not result, "over while the carrier was still waiting for the checkpoint process"
    release.set()
    waiter.join(5)
    assert result == [True]
