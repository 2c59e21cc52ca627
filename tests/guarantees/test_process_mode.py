"""``AsyncCheckpointerType.PROCESS`` at world size 2 with the state FSDP2/TP users save: DTensors
(sharded and replicated), nested containers and non-tensor items. The save must never crash the
trainer, and the checkpoint must load bit-exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config

ROWS = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7


def dtensor_state(step: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {
        "model": {
            "w": distribute_tensor(ROWS * step, mesh, [Shard(0)]),
            "b": distribute_tensor(torch.arange(6.0) + step, mesh, [Replicate()]),
            "plain": torch.full((3,), float(step)),
        },
        "optim": {"state": {"w": {"exp_avg": distribute_tensor(ROWS + step, mesh, [Shard(1)])}}},
        "nested": {"lists": [torch.ones(2) * step, {"deep": torch.zeros(1) + step}]},
        "step": step,
        "lr": 0.1 * step,
        "name": f"run-{step}",
    }


def assert_loads_dtensor_state(config: Config, step: int) -> dict[str, Any]:
    """Load ``step_<step>`` into a fresh :func:`dtensor_state` and compare every tensor bit for bit."""
    target = dtensor_state(0)
    dcp.load(target, storage_reader=TieredReader(config), checkpoint_id=f"step_{step:06d}")
    expected = dtensor_state(step)
    for key in ("w", "b"):
        assert torch.equal(target["model"][key].full_tensor(), expected["model"][key].full_tensor())
    assert torch.equal(target["model"]["plain"], expected["model"]["plain"])
    exp_avg = target["optim"]["state"]["w"]["exp_avg"].full_tensor()
    assert torch.equal(exp_avg, expected["optim"]["state"]["w"]["exp_avg"].full_tensor())
    assert torch.equal(target["nested"]["lists"][0], expected["nested"]["lists"][0])
    assert torch.equal(target["nested"]["lists"][1]["deep"], expected["nested"]["lists"][1]["deep"])
    return target


def save_and_load_in_process_mode(rank: int, world: int, config: Config) -> None:
    writer = TieredWriter(config)
    for step in (1, 2):  # the second save reuses the first one's staging buffers
        state = dtensor_state(step)
        future = dcp.async_save(
            state,
            storage_writer=writer,
            checkpoint_id=f"step_{step:06d}",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        for value in state["model"].values():  # the trainer moves on at once
            value.to_local().add_(1000) if hasattr(value, "to_local") else value.add_(1000)
        future.result()
    writer.close()
    for step in (1, 2):
        target = assert_loads_dtensor_state(config, step)
        assert (target["step"], target["lr"], target["name"]) == (step, 0.1 * step, f"run-{step}")


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_process_mode_with_dtensors_at_world_size_2(
    kind: str, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    run_ranks(save_and_load_in_process_mode, 2, tmp_path, make_config(kind))
