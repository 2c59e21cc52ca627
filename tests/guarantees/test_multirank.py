"""Two gloo ranks on loopback: save, then load at world size 1 and 2 (resharded), bit-exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.training import Trainer, assert_same, fresh_target
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config

GLOBAL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7


def sharded_state(trainer: Trainer, placement: Shard | None) -> dict[str, Any]:
    state = trainer.state()
    if placement is None:
        state["sharded"] = GLOBAL.clone() * 0
    else:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        state["sharded"] = distribute_tensor(GLOBAL.clone(), mesh, [placement])
    return state


def save_world2(rank: int, world: int, config: Config, use_async: bool) -> None:
    trainer = Trainer(seed=11)
    trainer.train(2)
    state = sharded_state(trainer, Shard(0))
    if use_async:  # staged: DTensor shards and replicated tensors go through the slab
        writer = TieredWriter(config)
        dcp.async_save(state, storage_writer=writer, checkpoint_id="step_000002").result()
        writer.close()
    else:
        dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="step_000002")
    assert latest_committed(config) == "step_000002"


def load_world2(rank: int, world: int, config: Config) -> None:
    expected = Trainer(seed=11)
    expected.train(2)
    target, state = fresh_target()
    mesh = init_device_mesh("cpu", (world,))
    state["sharded"] = distribute_tensor(torch.zeros_like(GLOBAL), mesh, [Shard(1)])
    reader = TieredReader(config)
    dcp.load(state, storage_reader=reader, checkpoint_id=latest_committed(config))
    target.restore(state)
    assert_same(expected.state(), target.state())
    sharded = state["sharded"]
    assert isinstance(sharded, DTensor)
    assert torch.equal(sharded.full_tensor(), GLOBAL), "resharded Shard(0) -> Shard(1) differs"
    assert reader.chosen_tier == config.tiers[0].name


@pytest.mark.parametrize(("kind", "use_async"), [("memory", True), ("s3", False)])
def test_world2_save_then_load_at_world_1_and_2(
    kind: str, use_async: bool, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config(kind)
    run_ranks(save_world2, 2, tmp_path, config, use_async)
    # world size 1, in this process: every rank's files, DTensor shards into one plain tensor
    expected = Trainer(seed=11)
    expected.train(2)
    target, state = fresh_target()
    state["sharded"] = torch.zeros_like(GLOBAL)
    dcp.load(state, storage_reader=TieredReader(config), checkpoint_id="step_000002")
    target.restore(state)
    assert_same(expected.state(), target.state())
    assert torch.equal(state["sharded"], GLOBAL)
    run_ranks(load_world2, 2, tmp_path, config)


def latest_fails_everywhere(rank: int, world: int, config: Config) -> None:
    from tierstore.errors import TierstoreError

    with pytest.raises(TierstoreError, match="finding the latest checkpoint failed on rank 0"):
        latest_committed(config)


def test_latest_committed_failing_on_rank_0_raises_on_every_rank(tmp_path: Path) -> None:
    from tierstore.config import config_from_dict

    unreachable = {
        "name": "s3",
        "type": "s3",
        "url": "s3://nowhere/x",
        "endpoint_url": "http://127.0.0.1:9",
        "max_attempts": 1,
    }
    config = config_from_dict({"tiers": [unreachable]})
    run_ranks(latest_fails_everywhere, 2, tmp_path, config)
