"""Staging for async_save: one copy into reusable buffers, isolated, adopted by a memory tier,
back-pressure, the commit gates, and the per-save timings."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tests.forked import in_forked_child
from tests.workers import run_ranks
from tierstore import LossBandGate, NonFiniteTensorError, TieredReader, TieredWriter, latest_committed
from tierstore._platform.owners import owner_dir_name
from tierstore.cli import main
from tierstore.config import Config
from tierstore.dcp.layout import has_nonfinite
from tierstore.dcp.save.gate import GateView
from tierstore.ids import staging_dir
from tierstore.interval import advise, daly, young
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier


def model_state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(64, 33, generator=generator) for i in range(5)},
        "ints": torch.arange(7, dtype=torch.int64),
        "half": torch.randn(9, generator=generator).half(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "train": {"loss": 1.5, "loss_avg": 1.4, "history": [1, 2, 3]},
        "step": seed,
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    out["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    out["train"] = {"loss": 0.0, "loss_avg": 0.0, "history": []}
    return out


def assert_loaded(config: Config, checkpoint_id: str, expected: dict[str, Any]) -> None:
    target = zeros_like(expected)
    dcp.load(target, storage_reader=TieredReader(config), checkpoint_id=checkpoint_id)
    for key, value in expected["model"].items():
        assert torch.equal(target["model"][key], value), key
    for key in ("ints", "half", "scalar", "empty"):
        assert torch.equal(target[key], expected[key]), key
    assert target["train"] == expected["train"] and target["step"] == expected["step"]


def tier0(config: Config) -> Any:
    return make_tier(config.tiers[0], namespace=config.namespace, node=0)


@pytest.mark.parametrize("kind", ["memory", "local", "s3"])
def test_staged_copy_is_isolated_from_the_trainer(kind: str, make_config: Callable[..., Config]) -> None:
    config = make_config(kind)
    state = model_state(1)
    expected = {**state, "model": {k: v.clone() for k, v in state["model"].items()}}
    writer = TieredWriter(config)
    future = dcp.async_save(state, storage_writer=writer, checkpoint_id="step_0001")
    for tensor in state["model"].values():  # the trainer moves on at once
        tensor.add_(100)
    state["train"]["history"].append(99)
    future.result()
    expected["train"] = {"loss": 1.5, "loss_avg": 1.4, "history": [1, 2, 3]}
    assert_loaded(config, "step_0001", expected)
    writer.close()


def test_memory_tier_adopts_the_slab_and_prepares_a_spare(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    writer = TieredWriter(config)
    state = model_state(2)
    dcp.async_save(state, storage_writer=writer, checkpoint_id="step_0002").result()
    stager = writer._stager_for_this_process()
    assert stager.slab is None and writer._staged.slab is None, (
        "a first save copies each tensor into process memory, not into a slab"
    )
    stager.wait_until_prepared()
    spare = stager.spare
    assert spare is not None and spare.path is not None, "a tmpfs spare is ready for the next save"
    spare_inode = os.stat(spare.path).st_ino
    dcp.async_save(model_state(3), storage_writer=writer, checkpoint_id="step_0003").result()
    assert stager.slab is spare and not os.path.exists(spare.path), "the slab became the checkpoint"
    manifest = read_manifest(tier0(config), "step_0003", trust=MarkerTrust())
    data = next(f for f in manifest.files if f.path.endswith("-0.distcp"))
    assert writer._staged.slab is not None and data.size == writer._staged.slab.nbytes
    data_path = tier0(config).local_path(f"step_0003/{data.path}")
    assert os.stat(data_path).st_ino == spare_inode, "renamed into place, not copied"
    assert_loaded(config, "step_0002", state)
    assert_loaded(config, "step_0003", model_state(3))
    writer.close()
    staging = Path(tier0(config).local_path(staging_dir()))
    assert not list(staging.glob("*/slab-*.bin")), "close() releases unused buffers"


def test_the_spare_is_prepared_only_once_the_save_is_handed_over(make_config: Callable[..., Config]) -> None:
    """The spare's allocation stays out of the stall: woken during it, the slab worker delayed the
    start of DCP's save thread by 3-20 ms on 2 cores."""
    config = make_config("memory")
    writer = TieredWriter(config)
    staged = writer.stage(model_state(4))  # a first save: copies, no slab
    stager = writer._stager_for_this_process()
    assert stager is not None and isinstance(staged, dict)
    time.sleep(0.2)  # time enough for a spare job queued by the stage to have started
    assert stager._preparing is None and stager.spare is None, "the spare was queued in the stall"
    dcp.save(staged, storage_writer=writer, checkpoint_id="step_0004")  # its thread reports in
    stager.wait_until_prepared()
    spare = stager.spare
    assert spare is not None, "the save reported in: the spare was prepared"
    preparing = stager._preparing
    staged = writer.stage(model_state(5))  # a steady save: copies into that spare
    assert stager.slab is spare and stager._preparing is preparing and stager.spare is None
    dcp.save(staged, storage_writer=writer, checkpoint_id="step_0005")
    assert stager._preparing is not preparing, "the next spare was queued at the handover"
    stager.wait_until_prepared()
    assert stager.spare is not None and stager.spare is not spare
    assert_loaded(config, "step_0004", model_state(4))
    assert_loaded(config, "step_0005", model_state(5))
    writer.close()


def test_a_first_saves_copies_are_freed_with_the_save(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    writer = TieredWriter(config)
    state = {"w": torch.randn(2**20), "b": torch.randn(7)}
    staged = writer.stage(state)
    assert isinstance(staged, dict)
    copies = [weakref.ref(staged["w"]), weakref.ref(staged["b"])]
    assert staged["w"].data_ptr() != state["w"].data_ptr(), "staging copies"
    dcp.save(staged, storage_writer=writer, checkpoint_id="step_0001")
    del staged
    assert all(copy() is None for copy in copies), "tierstore kept a first save's copy alive"
    target = {"w": torch.zeros(2**20), "b": torch.zeros(7)}
    dcp.load(target, storage_reader=TieredReader(config), checkpoint_id="step_0001")
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    writer.close()


_SYNC_AFTER_STAGE = """
import sys, torch, torch.distributed.checkpoint as dcp
from tierstore import TieredWriter
from tierstore.config import config_from_dict
config = config_from_dict({"tiers": [{"name": "ram", "type": "memory", "path": sys.argv[1]}]})
writer = TieredWriter(config)
for step in (1, 2, 3):
    staged = writer.stage({"w": torch.full((2**20,), float(step))})
    dcp.save(staged, storage_writer=writer, checkpoint_id=f"step_{step}")
    print(f"step_{step} saved", flush=True)
future = dcp.async_save({"w": torch.ones(2**20)}, storage_writer=writer, checkpoint_id="step_4")
future.add_done_callback(lambda _: writer.close())  # runs on DCP's save thread
future.result()
print("closed from a callback", flush=True)
"""


def test_a_synchronous_save_of_staged_state_and_close_in_a_callback_never_hang(tmp_path: Path) -> None:
    # The save then runs on the trainer's own thread, and close() on the save's thread: nothing
    # in the stager may wait for the thread that is waiting.
    done = subprocess.run(
        [sys.executable, "-c", _SYNC_AFTER_STAGE, str(tmp_path / "ram")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:4] == [
        "step_1 saved",
        "step_2 saved",
        "step_3 saved",
        "closed from a callback",
    ], done.stdout


def test_other_tiers_reuse_one_buffer(make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    writer = TieredWriter(config)
    dcp.async_save(model_state(1), storage_writer=writer, checkpoint_id="step_0001").result()
    stager = writer._stager_for_this_process()
    assert stager.slab is not None
    first = stager.slab.storage.data_ptr()
    dcp.async_save(model_state(2), storage_writer=writer, checkpoint_id="step_0002").result()
    assert stager.slab is not None and stager.slab.storage.data_ptr() == first
    assert_loaded(config, "step_0001", model_state(1))
    assert_loaded(config, "step_0002", model_state(2))


@pytest.mark.slow  # waits on purpose: make test runs it, make quick does not
def test_a_save_waits_for_the_previous_one_and_says_so(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config("memory")

    def slow(view: GateView) -> None:
        time.sleep(1.0)  # the previous save is still persisting

    writer = TieredWriter(config, commit_gate=slow)
    first = dcp.async_save(model_state(1), storage_writer=writer, checkpoint_id="step_0001")
    with caplog.at_level(logging.WARNING):
        started = time.perf_counter()
        second = dcp.async_save(model_state(2), storage_writer=writer, checkpoint_id="step_0002")
        stall = time.perf_counter() - started
    assert first.done(), "the second save did not start before the first finished"
    second.result()
    assert stall > 0.5
    assert "waited" in caplog.text and "previous save" in caplog.text
    timings = read_manifest(tier0(config), "step_0002", trust=MarkerTrust()).timings
    assert timings["wait_s"] is not None and timings["wait_s"] > 0.5
    assert timings["stall_s"] is not None and timings["stall_s"] >= timings["wait_s"]


def test_a_save_whose_planner_fails_does_not_hold_up_the_next(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    """With the id given to the writer, DCP makes no reset() call: its first call on the save's
    thread is storage_meta(), before the planner's set-up. A planner failing there used to leave
    the save unreported, and the next stage waited REGISTRATION_TIMEOUT (120 s) for it."""
    config = make_config("memory")

    class FailingPlanner(DefaultSavePlanner):
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("the planner fails")

    dcp.async_save(model_state(1), storage_writer=TieredWriter(config, checkpoint_id="step_0001")).result()
    failing = dcp.async_save(
        model_state(2),
        storage_writer=TieredWriter(config, checkpoint_id="step_0002"),
        planner=FailingPlanner(),
    )
    with pytest.raises(BaseException, match="the planner fails"):
        failing.result()
    with caplog.at_level(logging.WARNING):
        dcp.async_save(
            model_state(3), storage_writer=TieredWriter(config, checkpoint_id="step_0003")
        ).result()
    assert "never reported back" not in caplog.text
    wait_s = read_manifest(tier0(config), "step_0003", trust=MarkerTrust()).timings["wait_s"]
    assert wait_s is not None and wait_s < 10, f"waited {wait_s} s for the failed save"
    assert latest_committed(config) == "step_0003"
    assert_loaded(config, "step_0003", model_state(3))


def test_a_writer_used_before_a_fork_saves_in_the_child(make_config: Callable[..., Config]) -> None:
    """The child must not use the parent's stager: its worker thread, which prepares the spare the
    next save waits for, does not exist there (the child's second save hung)."""
    config = make_config("memory")
    writer = TieredWriter(config)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # after a fork torch's OpenMP pool hangs parallel ops, tierstore or not

    def save_in_child() -> int:
        for index in range(3):
            dcp.async_save(
                model_state(10 + index), storage_writer=writer, checkpoint_id=f"child_{index}"
            ).result()
        return 0

    try:
        for index in range(2):
            dcp.async_save(
                model_state(index), storage_writer=writer, checkpoint_id=f"parent_{index}"
            ).result()
        status = in_forked_child(save_in_child)
    finally:
        torch.set_num_threads(before)
    assert os.WIFEXITED(status), f"the child's saves hung ({status})"
    assert os.WEXITSTATUS(status) == 0
    for index in range(3):
        assert_loaded(config, f"child_{index}", model_state(10 + index))
    dcp.async_save(model_state(20), storage_writer=writer, checkpoint_id="parent_2").result()
    assert_loaded(config, "parent_2", model_state(20))
    writer.close()


def test_check_finite_refuses_nan_and_keeps_the_previous_latest(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", check_finite=True)
    writer = TieredWriter(config)
    dcp.async_save(model_state(1), storage_writer=writer, checkpoint_id="step_0001").result()
    poisoned = model_state(2)
    poisoned["model"]["w3"][5, 7] = float("nan")
    future = dcp.async_save(poisoned, storage_writer=writer, checkpoint_id="step_0002")
    with pytest.raises(BaseException, match=r"tensor 'model\.w3' holds NaN or Inf") as caught:
        future.result()
    assert "NonFiniteTensorError" in str(caught.value) or isinstance(caught.value, NonFiniteTensorError)
    assert latest_committed(config) == "step_0001"
    dcp.async_save(model_state(3), storage_writer=writer, checkpoint_id="step_0003").result()
    assert latest_committed(config) == "step_0003"
    infinite = model_state(4)
    infinite["half"][0] = float("inf")
    with pytest.raises(BaseException, match=r"tensor 'half' holds NaN or Inf"):
        dcp.save(infinite, storage_writer=TieredWriter(config), checkpoint_id="step_0004")


def test_loss_band_gate_vetoes_a_spike(make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    gate = LossBandGate(loss_key="train.loss", avg_key="train.loss_avg", band=3.0)
    writer = TieredWriter(config, commit_gate=gate)
    dcp.async_save(model_state(1), storage_writer=writer, checkpoint_id="step_0001").result()
    spiked = model_state(2)
    spiked["train"]["loss"] = 50.0
    future = dcp.async_save(spiked, storage_writer=writer, checkpoint_id="step_0002")
    with pytest.raises(
        BaseException, match=r"commit gate vetoed checkpoint 'step_0002' on rank 0: train.loss=50"
    ):
        future.result()
    assert latest_committed(config) == "step_0001"


def process_mode_isolation(rank: int, world: int, config: Config) -> None:
    writer = TieredWriter(config)
    for step in (1, 2, 3):  # consecutive saves: buffers are reused or replaced between them
        state = model_state(step)
        expected = {**state, "model": {k: v.clone() for k, v in state["model"].items()}}
        future = dcp.async_save(
            state,
            storage_writer=writer,
            checkpoint_id=f"step_{step:04d}",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        for tensor in state["model"].values():
            tensor.mul_(-1)
        future.result()
        assert_loaded(config, f"step_{step:04d}", expected)
    writer.close()


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_process_mode_consecutive_saves(
    kind: str, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    run_ranks(process_mode_isolation, 1, tmp_path, make_config(kind))


def test_timings_reach_ls_json_and_advise(
    make_config: Callable[..., Config],
    tier_specs: Callable[..., Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import yaml

    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"tiers": tier_specs("memory", "local")}))
    writer = TieredWriter(str(path))
    for step in (1, 2, 3):
        dcp.async_save(model_state(step), storage_writer=writer, checkpoint_id=f"step_{step:04d}").result()
    Promoter(writer.config).run_once()
    assert main(["--config", str(path), "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    for entry in listed:
        assert 0 < entry["stall_s"] <= entry["commit_s"]
        assert entry["durable_lag_s"] > 0, "promoted to the last tier: its durability lag is known"
    assert main(["--config", str(path), "advise", "--mtbf", "3600", "--restart", "60"]) == 0
    out = capsys.readouterr().out
    assert "Daly   (recommended)" in out and "expected waste" in out
    assert main(["--config", str(path), "advise", "--mtbf", "3600", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["saves_measured"] == 3


def test_interval_math() -> None:
    assert young(10, 3600) == pytest.approx(268.3, abs=0.1)
    assert daly(10, 3600) == pytest.approx(268.3 * (1 + (10 / 7200) ** 0.5 / 3 + 10 / 7200 / 9) - 10, abs=0.1)
    assert daly(10_000, 3600) == 3600
    advice = advise(10, 3600, restart=120, durable_lag=30)
    assert advice.waste_saving == pytest.approx(10 / advice.daly_s)
    assert advice.waste_rework == pytest.approx((advice.daly_s / 2 + 30) / 3600)
    assert advice.waste_restart == pytest.approx(120 / 3600)
    with pytest.raises(ValueError):
        advise(0, 3600)


def test_gc_removes_staging_of_dead_writers_only(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", promote={"stale_after": 0})
    tier = tier0(config)
    alive = owner_dir_name()
    dead = alive.replace(f"~{os.getpid()}~", "~999999~")
    for owner in (alive, dead):
        tier.write_bytes(f"{staging_dir()}/{owner}/slab-x.bin", b"buffer")
    cleaned = Promoter(config).run_once().cleaned
    assert [c.path for c in cleaned] == [f"{staging_dir()}/{dead}"]
    assert tier.exists(f"{staging_dir()}/{alive}/slab-x.bin")


def test_prepare_allocates_the_first_buffer_ahead(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    writer = TieredWriter(config)
    state = model_state(5)
    writer.prepare(state)
    stager = writer._stager_for_this_process()
    stager.wait_until_prepared()
    assert stager.spare is not None
    prepared = stager.spare.path
    dcp.async_save(state, storage_writer=writer, checkpoint_id="step_0005").result()
    assert stager.slab is not None and stager.slab.path == prepared, "the first save used it"
    assert_loaded(config, "step_0005", state)
    writer.close()


def test_a_writer_per_save_shares_the_buffers(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    first = TieredWriter(config)
    dcp.async_save(model_state(1), storage_writer=first, checkpoint_id="step_0001").result()
    second = TieredWriter(config)  # the common loop: storage_writer=TieredWriter(cfg) every save
    dcp.async_save(model_state(2), storage_writer=second, checkpoint_id="step_0002").result()
    shared = first._stager_for_this_process() is second._stager_for_this_process()
    assert shared, "one set of buffers per process and target tier"
    assert second._staged.report is None or second._staged.report.wait_s == 0
    assert_loaded(config, "step_0002", model_state(2))
    second.close()


def test_back_to_back_saves_never_share_a_buffer_in_use(make_config: Callable[..., Config]) -> None:
    config = make_config("local")  # a reused buffer: the case where overwriting would corrupt
    writer = TieredWriter(config)
    first, second = model_state(11), model_state(12)
    futures = [
        dcp.async_save(first, storage_writer=writer, checkpoint_id="step_0011"),
        dcp.async_save(second, storage_writer=writer, checkpoint_id="step_0012"),  # no wait between
    ]
    for future in futures:
        future.result()
    assert_loaded(config, "step_0011", first)
    assert_loaded(config, "step_0012", second)


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_check_finite_also_sees_sparse_tensors(layout: str, make_config: Callable[..., Config]) -> None:
    config = make_config("local", check_finite=True)
    values = torch.tensor([[0.0, 1.0], [float("nan"), 2.0]])
    bad = values.to_sparse() if layout == "sparse_coo" else values.to_sparse_csr()
    with pytest.raises(BaseException, match=r"tensor 'odd' holds NaN or Inf"):
        dcp.save({"odd": bad}, storage_writer=TieredWriter(config), checkpoint_id="step_0001")
    assert latest_committed(config) is None


def test_quantized_and_nested_tensors_cannot_carry_poison_into_a_checkpoint(
    make_config: Callable[..., Config],
) -> None:
    """Quantizing maps NaN/Inf to finite integers, so a quantized tensor holds none; nested tensors
    are refused by DCP's own planner before any byte is written."""
    quantized = torch.quantize_per_tensor(
        torch.tensor([1.0, float("inf"), float("nan")]), 0.1, 0, torch.qint8
    )
    assert not has_nonfinite(quantized)
    config = make_config("local", check_finite=True)
    nested = torch.nested.nested_tensor([torch.ones(3), torch.tensor([float("inf")])])
    with pytest.raises(BaseException, match="NestedTensorImpl"):
        dcp.save({"odd": nested}, storage_writer=TieredWriter(config), checkpoint_id="step_0001")
    assert latest_committed(config) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: benchmarks/gpu.py stages real copies")
def test_staging_waits_on_each_source_devices_stream_not_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank on cuda:1 staging on a thread whose current device is 0 must wait for its own copies:
    the wait goes to each source device's stream. CUDA is absent here, so torch's CUDA calls are
    stubbed (the code under test is not)."""
    from tierstore.dcp.staging.stager import wait_for_copies

    waited: list[str] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def synchronize(self) -> None:
            waited.append(str(self.device))

    def global_wait() -> None:
        raise AssertionError("torch.cuda.synchronize() waits on the current device only")

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "synchronize", global_wait)
    wait_for_copies({torch.device("cuda:1"), torch.device("cuda:3")})
    assert waited == ["cuda:1", "cuda:3"]
    wait_for_copies(set())
    assert waited == ["cuda:1", "cuda:3"], "no device copy, no wait"
