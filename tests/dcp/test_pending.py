"""When a staged save is over: the next stage() waits exactly as long as the previous save can still
read its buffers or use the writer, and no longer (see tierstore.dcp.staging.pending)."""

from __future__ import annotations

import _thread
import gc
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tests.dcp.test_staging import assert_loaded, model_state, tier0
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.dcp.save.gate import GateView
from tierstore.dcp.staging import pending as pending_module
from tierstore.dcp.staging.pending import Pending
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust


class SyncSaver:
    """A long-lived worker thread that runs synchronous ``dcp.save`` calls of staged states; a
    failed save is recorded (its exception only, not the staged state) and the thread goes on."""

    def __init__(self, writer: TieredWriter, planner: Callable[[], Any] = lambda: None) -> None:
        self.writer = writer
        self.planner = planner  # a new one per save: a planner holds the state it planned
        self.jobs: queue.Queue[tuple[Any, str] | None] = queue.Queue()
        self.done: queue.Queue[tuple[str, float]] = queue.Queue()
        self.failed: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="sync-saver")
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            staged, checkpoint_id = job
            try:
                dcp.save(
                    staged, storage_writer=self.writer, checkpoint_id=checkpoint_id, planner=self.planner()
                )
            except CheckpointException as exc:
                self.failed.append(f"{checkpoint_id}: {exc}")
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


def next_stage_while_a_save_runs(
    writer: TieredWriter, saver: SyncSaver, inside: threading.Event
) -> tuple[str, float, float]:
    """Stage step 1 and hand it to ``saver``; once ``inside`` is set (by the running save), stage
    step 2. Returns the id saved, when the second stage returned and when the save returned."""
    try:
        staged, _ = stage_in_thread(writer, model_state(1), deadline=30)
        saver.jobs.put((staged, "step_1"))
        assert inside.wait(30)
        _, staged_again = stage_in_thread(writer, model_state(2), deadline=30)
        saved, returned = saver.done.get(timeout=30)
    finally:
        saver.stop()
    return saved, staged_again, returned


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


def test_the_next_stage_still_waits_while_a_synchronous_save_runs(make_config: Callable[..., Config]) -> None:
    """The other half of the rule: while the long-lived thread is still inside DCP's save (here, in
    a slow commit gate), the next stage must not copy into the buffers it is writing."""
    config = make_config("local")  # the one staging buffer is reused: a copy into it too early
    in_gate = threading.Event()  # would change the save still being written

    def slow(view: GateView) -> None:
        in_gate.set()
        time.sleep(1.0)

    writer = TieredWriter(config, commit_gate=slow)
    saved, staged_again, returned = next_stage_while_a_save_runs(writer, SyncSaver(writer), in_gate)
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
            model_state(1),
            storage_writer=writer,
            checkpoint_id="step_1",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
    started = time.perf_counter()
    dcp.async_save(model_state(2), storage_writer=writer, checkpoint_id="step_2").result()
    assert time.perf_counter() - started < 10
    wait_s = read_manifest(tier0(config), "step_2", trust=MarkerTrust()).timings["wait_s"]
    assert wait_s is not None and wait_s < 5, f"waited {wait_s} s for a save nobody carries"
    assert_loaded(config, "step_2", model_state(2))


def test_an_unreported_save_whose_tensors_are_alive_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
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


class FailsFirst(DefaultSavePlanner):
    """Fails the first ``failures[0]`` plans it makes (a transient error), then plans normally."""

    failures = [1]

    def create_local_plan(self) -> Any:
        if self.failures[0] > 0:
            self.failures[0] -= 1
            raise OSError("transient: the tier is briefly unavailable")
        return super().create_local_plan()


def test_a_retry_after_the_next_stage_is_refused_not_committed_with_the_later_state(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saver thread retries a failed save of a staged state after a back-off, and the trainer
    staged the next state meanwhile (into the same buffer, which the failed save no longer used).
    The retry would commit step_1 with step_2's bytes: it is refused, naming the checkpoint."""
    config = make_config("local")
    monkeypatch.setattr(FailsFirst, "failures", [1])
    writer = TieredWriter(config)
    failed, retried = threading.Event(), threading.Event()
    retry_error: list[BaseException] = []

    def save_with_retry(staged: Any) -> None:
        try:
            dcp.save(staged, storage_writer=writer, checkpoint_id="step_1", planner=FailsFirst())
        except CheckpointException:
            failed.set()
            time.sleep(0.5)  # back off, then retry the same staged state
            try:
                dcp.save(staged, storage_writer=writer, checkpoint_id="step_1", planner=FailsFirst())
            except CheckpointException as exc:
                retry_error.append(exc)
            retried.set()

    state = {"w": torch.full((4096,), 1.0)}
    saver = threading.Thread(target=save_with_retry, args=(writer.stage(state),), daemon=True)
    saver.start()
    assert failed.wait(30)
    state["w"].fill_(2.0)  # training goes on, and the next save stages without waiting
    staged, _ = stage_in_thread(writer, state, deadline=30)
    assert not retried.is_set()
    assert retried.wait(30)
    assert retry_error, "the retry of a superseded staged state was committed"
    assert "StaleStagedStateError" in str(retry_error[0])
    assert "'step_1'" in str(retry_error[0]) and "stage the state again" in str(retry_error[0])
    assert latest_committed(config) is None
    dcp.save(staged, storage_writer=writer, checkpoint_id="step_2")
    assert_loaded_values(config, {"step_2": 2.0})


def test_a_retry_before_the_next_stage_commits_the_staged_state(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("local")
    monkeypatch.setattr(FailsFirst, "failures", [1])
    writer = TieredWriter(config)
    state = {"w": torch.full((4096,), 1.0)}
    staged = writer.stage(state)
    state["w"].fill_(2.0)  # the trainer's tensors move on; the staged copy does not
    with pytest.raises(CheckpointException):
        dcp.save(staged, storage_writer=writer, checkpoint_id="step_1", planner=FailsFirst())
    dcp.save(staged, storage_writer=writer, checkpoint_id="step_1", planner=FailsFirst())
    assert_loaded_values(config, {"step_1": 1.0})


def test_close_after_a_failed_synchronous_save_returns(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("local")
    monkeypatch.setattr(FailsFirst, "failures", [1])
    writer = TieredWriter(config)
    saver = SyncSaver(writer, planner=FailsFirst)
    staged = writer.stage(model_state(1))
    saver.jobs.put((staged, "step_1"))  # the caller keeps its name for the staged state
    assert saver.done.get(timeout=30)[0] == "step_1" and saver.failed
    closing = threading.Thread(target=writer.close, daemon=True)
    closing.start()
    closing.join(30)
    saver.stop()
    assert not closing.is_alive(), "close() waits for a failed save whose thread lives on"


def test_a_failed_synchronous_save_whose_state_was_dropped_does_not_hold_up_the_next(
    make_config: Callable[..., Config],
) -> None:
    """The save failed, its thread lives on, and nothing holds its staged state: no retry can
    come, so the next stage goes ahead (it used to wait for the thread to end, forever)."""
    config = make_config("local")
    failures = [1]

    class FailsOnce(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            if failures:
                failures.pop()
                raise OSError("the tier is unavailable")
            return super().create_local_plan()

    writer = TieredWriter(config)
    saver = SyncSaver(writer, planner=FailsOnce)
    try:
        saver.jobs.put((writer.stage(model_state(1)), "step_1"))
        assert saver.done.get(timeout=30)[0] == "step_1"
        assert saver.failed and "the tier is unavailable" in saver.failed[0]
        staged, _ = stage_in_thread(writer, model_state(2), deadline=30)
        saver.jobs.put((staged, "step_2"))
        assert saver.done.get(timeout=30)[0] == "step_2"
    finally:
        saver.stop()
    assert len(saver.failed) == 1
    assert_loaded(config, "step_2", model_state(2))


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_two_threads_saving_through_two_writers_to_one_tier_keep_their_states_apart(
    make_config: Callable[..., Config], kind: str
) -> None:
    """Writers of one tier share the process's stager: two stages at once copied into the same
    buffer, and a writer could carry the other thread's Pending."""
    config = make_config(kind)
    start = threading.Barrier(2)
    errors: list[str] = []
    expected: dict[str, float] = {}

    def trainer(name: str, offset: float) -> None:
        try:
            writer = TieredWriter(config)
            for index in range(3):
                value = offset + index
                expected[f"{name}{index}"] = value
                state = {"w": torch.full((1 << 20,), value)}
                start.wait(30)
                dcp.async_save(state, storage_writer=writer, checkpoint_id=f"{name}{index}").result()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {exc!r}")

    threads = [threading.Thread(target=trainer, args=(n, o)) for n, o in (("x", 10), ("y", 20))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert_loaded_values(config, expected)


def test_a_save_carried_by_a_thread_threading_did_not_start(make_config: Callable[..., Config]) -> None:
    """A carrier started with _thread (or by C++ code calling into Python) is a dummy thread:
    joining it raises, and it never reports its end. The next stage waits on its stack instead."""
    config = make_config("local")
    in_gate, done = threading.Event(), threading.Event()

    def slow(view: GateView) -> None:
        in_gate.set()
        time.sleep(0.5)

    writer = TieredWriter(config, commit_gate=slow)

    def carry(staged: Any) -> None:
        dcp.save(staged, storage_writer=writer, checkpoint_id="step_1")
        done.set()

    _thread.start_new_thread(carry, (writer.stage(model_state(1)),))
    assert in_gate.wait(30)
    stage_in_thread(writer, model_state(2), deadline=30)
    assert done.is_set(), "the next stage copied while the save was running"
    assert_loaded(config, "step_1", model_state(1))


def assert_loaded_values(config: Config, expected: dict[str, float]) -> None:
    """Every checkpoint holds one tensor ``w`` filled with its expected value, and only that."""
    for checkpoint_id, value in expected.items():
        target = {"w": torch.zeros(4096 if checkpoint_id.startswith("step") else 1 << 20)}
        dcp.load(target, storage_reader=TieredReader(config), checkpoint_id=checkpoint_id)
        assert target["w"].unique().tolist() == [value], checkpoint_id


def stale_dtensor_retry(rank: int, world: int, config: Config) -> None:
    """A DTensor state reaches the storage writer through StagedShard's aliases: the stage's token
    must survive them, or a superseded DTensor state would be committed with the later bytes."""
    mesh = init_device_mesh("cpu", (world,))
    writer = TieredWriter(config)
    state = {"w": DTensor.from_local(torch.full((64,), 1.0), mesh, [Shard(0)])}
    first = writer.stage(state)
    FailsFirst.failures = [1]
    with pytest.raises(CheckpointException, match="transient"):
        dcp.save(first, storage_writer=writer, checkpoint_id="step_1", planner=FailsFirst())
    state["w"].to_local().fill_(2.0)
    second = writer.stage(state)
    with pytest.raises(CheckpointException, match="StaleStagedStateError"):
        dcp.save(first, storage_writer=writer, checkpoint_id="step_1")
    dcp.save(second, storage_writer=writer, checkpoint_id="step_2")
    loaded = {"w": DTensor.from_local(torch.zeros(64), mesh, [Shard(0)])}
    dcp.load(loaded, storage_reader=TieredReader(config), checkpoint_id="step_2")
    assert loaded["w"].to_local().unique().tolist() == [2.0]
    assert latest_committed(config) == "step_2"


def test_a_superseded_dtensor_state_is_refused(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    run_ranks(stale_dtensor_retry, 1, tmp_path, make_config("local"))


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_retry_on_another_thread_is_written_whole_before_the_next_stage_copies(
    make_config: Callable[..., Config], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed attempt's thread has left DCP, so the back-pressure rule lets the next stage go;
    the retry runs on another thread that nothing registered. The next stage must wait for the
    retry's write of the slab (it read the header once, then wrote the next step's bytes under it;
    on a memory tier it could even copy into the slab the retry had just renamed into a checkpoint).
    """
    config = make_config(kind)
    monkeypatch.setattr(FailsFirst, "failures", [1])
    resolving = threading.Event()

    class Signals(FailsFirst):
        def resolve_data(self, write_item: Any) -> Any:
            resolving.set()  # a signal only: no delay
            return super().resolve_data(write_item)

    writer = TieredWriter(config)
    state = {"a": torch.full((16,), 1.0), "w": torch.full((8 << 20,), 1.0)}  # 32 MiB
    if kind == "memory":  # a spare exists: the retry's slab is then reused only if not adopted
        dcp.save(writer.stage(state), storage_writer=writer, checkpoint_id="step_0")
    staged = writer.stage(state)
    outcome: list[str] = []

    def attempt() -> None:
        try:
            dcp.save(staged, storage_writer=writer, checkpoint_id="step_1", planner=Signals())
            outcome.append("committed")
        except CheckpointException as exc:
            outcome.append(f"failed: {exc}")

    first = threading.Thread(target=attempt)
    first.start()
    first.join(30)
    assert outcome and outcome[0].startswith("failed") and "transient" in outcome[0]
    retry = threading.Thread(target=attempt)
    retry.start()
    assert resolving.wait(30)
    state["a"].fill_(2.0)
    state["w"].fill_(2.0)
    staged_next, _ = stage_in_thread(writer, state, deadline=60)
    retry.join(30)
    assert outcome[1] == "committed" or "StaleStagedStateError" in outcome[1], outcome[1]
    if outcome[1] == "committed":
        loaded = {"a": torch.zeros(16), "w": torch.zeros(8 << 20)}
        dcp.load(loaded, storage_reader=TieredReader(config), checkpoint_id="step_1")
        assert {k: v.unique().tolist() for k, v in loaded.items()} == {"a": [1.0], "w": [1.0]}
    dcp.save(staged_next, storage_writer=writer, checkpoint_id="step_2")
    loaded = {"a": torch.zeros(16), "w": torch.zeros(8 << 20)}
    dcp.load(loaded, storage_reader=TieredReader(config), checkpoint_id="step_2")
    assert {k: v.unique().tolist() for k, v in loaded.items()} == {"a": [2.0], "w": [2.0]}


def test_the_owner_of_the_future_ends_the_wait_while_the_carrier_lives_on() -> None:
    """The explicit signal (``TieredWriter.over_when``, used by the CheckpointManager): a save whose
    future is done is over at once, though its carrier thread lives on and no event says so."""
    release = threading.Event()
    carrier = threading.Thread(target=release.wait, daemon=True)
    carrier.start()
    pending = Pending([torch.zeros(1)])
    pending.register(carrier, in_process=False)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(pending.wait()), daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert not result
    pending.finish()
    waiter.join(2)
    assert result == [True] and carrier.is_alive()
    release.set()


def test_the_manager_frees_the_staging_buffers_from_its_future(make_config: Callable[..., Config]) -> None:
    """A writer whose last save's future is done does not infer: its last staged save is finished."""
    writer = TieredWriter(make_config("memory"))
    future = dcp.async_save(model_state(1), storage_writer=writer, checkpoint_id="step_1")
    assert isinstance(future, Future)
    writer.over_when(future)
    future.result()
    last = writer._staged.last
    assert last is not None and last._over.is_set()
    writer.close()
