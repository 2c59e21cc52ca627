"""The parts of torch.distributed.checkpoint that tierstore relies on. If torch moves them, these
tests fail loudly (rather than checkpoints failing quietly); see the torch pin in pyproject.toml."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tierstore import TieredReader, TieredWriter
from tierstore.config import Config
from tierstore.dcp.save import RankAssignment, RankFiles, RankReport


def test_torch_version_is_in_the_supported_range() -> None:
    assert torch.__version__.startswith("2.13."), torch.__version__


def test_storage_interfaces_have_the_methods_we_implement() -> None:
    assert StorageWriter.__abstractmethods__ == {
        "reset",
        "set_up_storage_writer",
        "prepare_local_plan",
        "prepare_global_plan",
        "write_data",
        "finish",
        "validate_checkpoint_id",
    }
    assert StorageReader.__abstractmethods__ == {
        "reset",
        "read_metadata",
        "set_up_storage_reader",
        "prepare_local_plan",
        "prepare_global_plan",
        "read_data",
        "validate_checkpoint_id",
    }
    assert not TieredWriter.__abstractmethods__ and not TieredReader.__abstractmethods__


def test_checkpoint_exception_is_not_an_exception() -> None:
    # Users must catch BaseException (or CheckpointException) around dcp.save/load: documented.
    assert issubclass(CheckpointException, BaseException)
    assert not issubclass(CheckpointException, Exception)


class RecordingWriter(TieredWriter):
    calls: list[tuple[str, Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []

    def reset(self, checkpoint_id: Any = None) -> None:
        self.calls.append(("reset", checkpoint_id))
        super().reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("set_up", dict(kwargs)))
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        out = super().prepare_local_plan(plan)
        self.calls.append(("local_plan", out.storage_data))
        return out

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.calls.append(("global_plan", [p.storage_data for p in plans]))
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.calls.append(("write_data", plan.storage_data))
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        self.calls.append(("finish", results))
        super().finish(metadata, results)


def test_save_call_order_and_plan_storage_data_round_trip(make_config: Callable[..., Config]) -> None:
    writer = RecordingWriter(make_config("local"))
    dcp.save({"w": torch.ones(3), "n": 1}, storage_writer=writer, checkpoint_id="step_1")
    names = [name for name, _ in writer.calls]
    assert names == ["reset", "set_up", "local_plan", "global_plan", "write_data", "finish"]
    set_up = dict(writer.calls)["set_up"]
    assert set_up.get("rank") == 0, "DCP passes rank= only to a variadic parameter named kwargs"
    assert "kwargs" in inspect.signature(TieredWriter.set_up_storage_writer).parameters
    assert isinstance(dict(writer.calls)["global_plan"][0], RankReport)
    assert isinstance(dict(writer.calls)["write_data"], RankAssignment)
    results = dict(writer.calls)["finish"]
    assert any(isinstance(r.storage_data, RankFiles) for r in results[0]), "results reach finish as-is"


def test_reader_read_metadata_has_no_kwargs_parameter() -> None:
    # With a variadic named `kwargs`, DCP retries read_metadata(rank=...) after a failure, a second
    # collective on some ranks only; tierstore names it otherwise on purpose.
    assert "kwargs" not in inspect.signature(TieredReader.read_metadata).parameters


def test_writer_is_dcps_stager_and_skips_the_deprecated_sync(make_config: Any) -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    assert AsyncStager in TieredWriter.__mro__
    assert TieredWriter._synchronize_after_execute is False
    assert isinstance(TieredWriter(make_config("local")), AsyncStager), "async_save's own check"


def test_shared_memory_slabs_travel_to_the_checkpoint_process_without_a_copy(tmp_path: Any) -> None:
    import io
    from multiprocessing.reduction import ForkingPickler

    from tierstore.dcp.layout import view_of
    from tierstore.dcp.staging.stager import Slab

    for path in (None, str(tmp_path / "slab.bin")):  # anonymous shared memory, a tmpfs-like file
        slab = Slab(8 * 2**20, path)
        tensor = view_of(slab.storage, 64, torch.float32, (2**20,))
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(tensor)
        assert len(buffer.getvalue()) < 4096, "pickled by file descriptor, not by value"
        slab.release()


def test_dcp_plans_tensors_through_the_checkpoint_protocol_staged_shards_speak() -> None:
    """StagedShard stands in for a DTensor by answering DCP's checkpoint protocol: the planner must
    still ask objects for ``__create_write_items__`` and the lookup for ``__get_tensor_shard__``."""
    import inspect

    from torch.distributed.checkpoint import planner_helpers, utils
    from torch.distributed.tensor import DTensor

    assert "__create_write_items__" in inspect.getsource(planner_helpers._create_write_items)
    assert "__get_tensor_shard__" in inspect.getsource(utils.find_tensor_shard)
    assert all(
        hasattr(DTensor, name)
        for name in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")
    )


def test_filesystem_readers_storage_record_is_what_the_export_writes() -> None:
    # tierstore.dcp.tools.torch_files builds these for FileSystemReader: a private torch class.
    fields = [f.name for f in dataclasses.fields(_StorageInfo)]
    assert fields == ["relative_path", "offset", "length", "transform_descriptors"]
