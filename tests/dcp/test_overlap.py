"""Overlapped saves (``TieredWriter(overlap=True)``): ``async_save`` returns an ``AsyncSaveResponse``
before the copy, the staged copy is isolated once ``staging_completion`` resolves, the marker appears
only with ``upload_completion``, failures reach both futures, saves stay in call order, and overlapped
and plain saves mix on one namespace. Nothing here measures time: "before" is shown by a save held
at a gate the test controls."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

from tests.dcp.test_staging import assert_loaded, model_state, tier0
from tests.guarantees.test_process_mode import assert_loads_dtensor_state, dtensor_state
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.dcp.save.gate import GateView
from tierstore.dcp.staging.overlap import StagingQueue
from tierstore.ids import marker_path, staging_dir
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

MODES = [AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS]


class HeldGate:
    """A commit gate that holds every save just before its marker until :meth:`release`."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.reached = threading.Event()

    def __call__(self, view: GateView) -> None:
        self.reached.set()
        assert self.released.wait(60), "the test never released the gate"

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def gate() -> Iterator[HeldGate]:
    """A held gate, released at the end of the test whatever happens (no save left waiting)."""
    held = HeldGate()
    yield held
    held.release()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """The values ``model_state`` holds now, copied (what the checkpoint must contain)."""
    return {
        **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()},
        "model": {k: v.clone() for k, v in state["model"].items()},
        "train": {**state["train"], "history": list(state["train"]["history"])},
    }


def scribble(state: dict[str, Any]) -> None:
    """What the optimizer step does to the state, and more."""
    for tensor in state["model"].values():
        tensor.add_(100)
    state["ints"].mul_(-1)
    state["train"]["history"].append(99)


def save(writer: TieredWriter, state: dict[str, Any], checkpoint_id: str) -> AsyncSaveResponse:
    response = dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
    assert isinstance(response, AsyncSaveResponse), "overlap=True returns both futures"
    return response


def test_async_save_returns_before_the_copy_and_saves_keep_their_order(
    make_config: Callable[..., Config], gate: HeldGate
) -> None:
    config = make_config("memory")
    writer = TieredWriter(config, overlap=True, commit_gate=gate)
    states = [model_state(seed) for seed in (1, 2, 3)]
    expected = [snapshot(s) for s in states]
    first = save(writer, states[0], "step_0001")
    first.staging_completion.result()
    assert gate.reached.wait(60), "the first save reached its commit gate"
    # The first save holds its buffer: the next ones cannot copy until it is over, yet return.
    second = save(writer, states[1], "step_0002")
    third = save(writer, states[2], "step_0003")
    assert not gate.released.is_set()
    assert not second.staging_completion.done() and not third.staging_completion.done()
    assert not first.upload_completion.done()
    gate.release()
    for response in (first, second, third):
        response.staging_completion.result()
        response.upload_completion.result()
    seqs = [read_manifest(tier0(config), f"step_000{i}", trust=MarkerTrust()).seq for i in (1, 2, 3)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3, "committed in the order of the calls"
    assert latest_committed(config, collective=False) == "step_0003"
    for i, state in enumerate(expected, start=1):
        assert_loaded(config, f"step_000{i}", state)
    writer.close()


@pytest.mark.parametrize("kind", ["memory", "local", "s3"])
def test_changes_after_staging_completion_do_not_reach_the_checkpoint(
    kind: str, make_config: Callable[..., Config], gate: HeldGate
) -> None:
    config = make_config(kind)
    writer = TieredWriter(config, overlap=True, commit_gate=gate)
    state = model_state(4)
    expected = snapshot(state)
    response = save(writer, state, "step_0004")
    response.staging_completion.result()
    scribble(state)  # while the save is still writing: it is held at the gate
    assert not response.upload_completion.done()
    assert not tier0(config).exists(marker_path("step_0004")), "no marker before the upload"
    gate.release()
    response.upload_completion.result()
    assert tier0(config).exists(marker_path("step_0004")), "the marker with upload_completion"
    assert_loaded(config, "step_0004", expected)
    writer.close()


def test_the_configuration_turns_overlap_on(make_config: Callable[..., Config]) -> None:
    config = make_config("local", staging={"overlap": True})
    assert TieredWriter(config).overlap and not TieredWriter(config, overlap=False).overlap
    state = model_state(5)
    expected = snapshot(state)
    response = save(TieredWriter(config), state, "step_0005")
    response.staging_completion.result()
    scribble(state)
    response.upload_completion.result()
    assert_loaded(config, "step_0005", expected)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_overlapped_and_plain_saves_alternate_on_one_namespace(
    kind: str, make_config: Callable[..., Config]
) -> None:
    config = make_config(kind, namespace="mixed")
    pending: list[Any] = []
    expected: dict[str, dict[str, Any]] = {}
    for step in range(1, 7):  # never waiting for the previous save: back-pressure orders them
        state = model_state(step)
        checkpoint_id = f"step_{step:04d}"
        expected[checkpoint_id] = snapshot(state)
        writer = TieredWriter(config, overlap=step % 2 == 0)
        result = dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
        if writer.overlap:
            assert isinstance(result, AsyncSaveResponse)
            result.staging_completion.result()
            pending.append(result.upload_completion)
        else:
            assert not isinstance(result, AsyncSaveResponse), "the default is unchanged"
            pending.append(result)
        scribble(state)
    for future in pending:
        future.result()
    seqs = [read_manifest(tier0(config), c, trust=MarkerTrust()).seq for c in expected]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert latest_committed(config, collective=False) == "step_0006"
    for checkpoint_id, state in expected.items():
        assert_loaded(config, checkpoint_id, state)
    TieredWriter(config).close()


def test_a_plain_save_waits_for_overlapped_staging_queued_before_it(
    make_config: Callable[..., Config], gate: HeldGate
) -> None:
    config = make_config("local")  # one reused buffer: a save that jumped the queue would share it
    held = save(TieredWriter(config, overlap=True, commit_gate=gate), model_state(1), "step_0001")
    held.staging_completion.result()
    assert gate.reached.wait(60)
    queued = save(TieredWriter(config, overlap=True), model_state(2), "step_0002")
    plain: list[Any] = []
    trainer = threading.Thread(
        target=lambda: plain.append(
            dcp.async_save(model_state(3), storage_writer=TieredWriter(config), checkpoint_id="step_0003")
        )
    )
    trainer.start()
    trainer.join(0.5)  # time for it to get as far as it may; it may not pass the queued staging
    assert trainer.is_alive() and not queued.staging_completion.done()
    gate.release()
    trainer.join()
    for future in (held.upload_completion, queued.upload_completion, plain[0]):
        future.result()
    seqs = [read_manifest(tier0(config), f"step_000{i}", trust=MarkerTrust()).seq for i in (1, 2, 3)]
    assert seqs == sorted(seqs), "committed in the order of the calls"
    for step in (1, 2, 3):
        assert_loaded(config, f"step_000{step}", model_state(step))


# -- failures ------------------------------------------------------------------------------------


def assert_both_raise(response: AsyncSaveResponse, match: str) -> None:
    with pytest.raises(BaseException, match=match):
        response.staging_completion.result(timeout=120)
    with pytest.raises(BaseException, match=match):
        response.upload_completion.result(timeout=120)


def test_a_full_memory_tier_fails_both_futures_and_leaves_nothing(
    small_tmpfs: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", tiers={"memory": {"path": str(small_tmpfs)}})
    writer = TieredWriter(config, overlap=True)
    response = save(writer, {"w": torch.ones(1_000_000)}, "step_0001")  # 4 MB into 1 MiB
    assert_both_raise(response, "a staging buffer needs 4000064 bytes")
    assert not tier0(config).exists(marker_path("step_0001"))
    staging = Path(tier0(config).local_path(staging_dir()))
    assert not list(staging.glob("*/slab-*.bin")), "the slab that did not fit is removed"
    small = {"w": torch.ones(1000)}
    save(writer, small, "step_0002").upload_completion.result()  # the writer still works
    loaded = {"w": torch.zeros(1000)}
    dcp.load(loaded, storage_reader=TieredReader(config), checkpoint_id="step_0002")
    assert torch.equal(loaded["w"], small["w"])
    writer.close()


def failing_then_working(rank: int, world: int, config: Config, mode: str) -> None:
    """A Partial DTensor cannot be staged (DCP refuses it too): both futures raise, nothing is
    committed, and the next save from the same writer succeeds."""
    mesh = init_device_mesh("cpu", (world,))
    writer = TieredWriter(config, overlap=True)
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    kind = AsyncCheckpointerType(mode)
    response = dcp.async_save(
        {"p": partial}, storage_writer=writer, checkpoint_id="step_0001", async_checkpointer_type=kind
    )
    assert isinstance(response, AsyncSaveResponse)
    assert_both_raise(response, "partial placements")
    assert latest_committed(config) is None
    state = model_state(6)
    response = dcp.async_save(
        state, storage_writer=writer, checkpoint_id="step_0002", async_checkpointer_type=kind
    )
    assert isinstance(response, AsyncSaveResponse)
    response.upload_completion.result()
    assert_loaded(config, "step_0002", model_state(6))
    writer.close()


@pytest.mark.parametrize("mode", [m.value for m in MODES])
def test_a_staging_failure_fails_both_futures(
    mode: str, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    run_ranks(failing_then_working, 1, tmp_path, make_config("local"), mode)


# -- PROCESS mode and DTensors at world size 2 -----------------------------------------------------


def isolated_dtensor_saves(rank: int, world: int, config: Config, mode: str) -> None:
    writer = TieredWriter(config, overlap=True)
    for step in (1, 2, 3):  # consecutive saves: buffers are reused or replaced between them
        state = dtensor_state(step)
        response = dcp.async_save(
            state,
            storage_writer=writer,
            checkpoint_id=f"step_{step:06d}",
            async_checkpointer_type=AsyncCheckpointerType(mode),
        )
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result()
        for value in (*state["model"].values(), state["optim"]["state"]["w"]["exp_avg"]):
            (value.to_local() if isinstance(value, DTensor) else value).add_(1000)
        state["nested"]["lists"][0].mul_(-1)
        response.upload_completion.result()
    writer.close()
    dist.barrier()
    for step in (1, 2, 3):
        target = assert_loads_dtensor_state(config, step)
        assert (target["step"], target["name"]) == (step, f"run-{step}")


@pytest.mark.parametrize("mode", [m.value for m in MODES])
def test_dtensor_saves_at_world_size_2_are_isolated(
    mode: str, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    run_ranks(isolated_dtensor_saves, 2, tmp_path, make_config("memory"), mode)


def isolated_process_saves(rank: int, world: int, config: Config) -> None:
    writer = TieredWriter(config, overlap=True)
    for step in (1, 2, 3):
        state = model_state(step)
        expected = snapshot(state)
        response = dcp.async_save(
            state,
            storage_writer=writer,
            checkpoint_id=f"step_{step:04d}",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result()
        scribble(state)
        response.upload_completion.result()
        assert_loaded(config, f"step_{step:04d}", expected)
    writer.close()


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_process_mode_isolation(kind: str, tmp_path: Path, make_config: Callable[..., Config]) -> None:
    run_ranks(isolated_process_saves, 1, tmp_path, make_config(kind))


class _Staged:
    """Stands for a staged state: views into a slab, whose last reference unmaps it."""


def _collected(ref: weakref.ref[_Staged]) -> bool:
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # the job's thread drops its references as it ends
    return ref() is None


def test_the_staging_queue_keeps_no_staged_state_alive() -> None:
    # Unmapping a slab whose checkpoint was already deleted frees its pages with the GIL held
    # (60-120 ms per GiB, every thread of the trainer stops): a staged state must die with the
    # save that used it, not when the queue moves on.
    queue = StagingQueue()
    first = queue.submit(_Staged)
    ref = weakref.ref(first.result())
    del first
    gate = threading.Event()
    second = queue.submit(lambda: gate.wait(10))  # runs after the first, and is still running
    assert _collected(ref), "the queue held the previous job's result while the next job ran"
    gate.set()
    second.result(timeout=10)
    third = queue.submit(_Staged)
    ref = weakref.ref(third.result())
    del third
    queue.wait_until_idle()
    assert _collected(ref), "the queue held its last job's result"


def test_waiting_on_an_idle_staging_queue_wakes_no_thread() -> None:
    # Every plain stage() waits for the queue on the trainer's thread, inside the stall: with
    # nothing queued that wait must not be a round trip through the queue's worker thread.
    queue = StagingQueue(name="tierstore-stage-idle-check")
    queue.wait_until_idle()
    assert not [t for t in threading.enumerate() if t.name == "tierstore-stage-idle-check"]


def test_waiting_on_the_staging_queue_waits_for_every_job_submitted() -> None:
    queue = StagingQueue()
    gate = threading.Event()
    ran: list[int] = []
    queue.submit(lambda: gate.wait(10))
    queue.submit(lambda: ran.append(2))
    idle = threading.Event()
    waiter = threading.Thread(target=lambda: (queue.wait_until_idle(), idle.set()))
    waiter.start()
    assert not idle.wait(0.3), "the wait returned while a job was still running"
    gate.set()
    assert idle.wait(10)
    assert ran == [2], "the wait returned before the last job had run"
    waiter.join(10)


def test_waiting_on_the_staging_queue_from_its_own_job_is_refused() -> None:
    # The job would wait for itself forever.
    queue = StagingQueue()
    with pytest.raises(RuntimeError, match="waits forever"):
        queue.submit(queue.wait_until_idle).result(timeout=10)
