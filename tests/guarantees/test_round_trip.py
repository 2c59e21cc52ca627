"""A realistic training state survives save and load bit-exactly, through every tier type."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tests.training import Trainer, assert_same, fresh_target
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config

KINDS = ["memory", "local", "shared", "s3"]


def restore_and_compare(config: Config, checkpoint_id: str, trainer: Trainer) -> str:
    """Load into a differently initialised trainer and check it equals the saved one."""
    expected = trainer.state()
    target, state = fresh_target()
    reader = TieredReader(config)
    dcp.load(state, storage_reader=reader, checkpoint_id=checkpoint_id)
    target.restore(state)
    assert_same(expected, target.state())
    assert reader.chosen_tier is not None
    return reader.chosen_tier


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_async_save_round_trip(kind: str, make_config: Callable[..., Config]) -> None:
    config = make_config(kind)
    trainer = Trainer(seed=0)
    trainer.train(3)
    dcp.save(trainer.state(), storage_writer=TieredWriter(config), checkpoint_id="step_000003")
    assert restore_and_compare(config, "step_000003", trainer) == kind
    trainer.train(2)
    future = dcp.async_save(trainer.state(), storage_writer=TieredWriter(config), checkpoint_id="step_000005")
    trainer_after = trainer.state()
    future.result()
    assert latest_committed(config) == "step_000005"
    assert restore_and_compare(config, "step_000005", trainer) == kind
    assert_same(trainer_after, trainer.state())


def test_writer_and_reader_take_a_yaml_path_and_an_id(tmp_path: Path) -> None:
    path = tmp_path / "tierstore.yaml"
    path.write_text(f"tiers:\n  - {{name: disk, type: local, path: '{tmp_path}/disk'}}\n")
    trainer = Trainer(seed=2)
    trainer.train(1)
    dcp.save(trainer.state(), storage_writer=TieredWriter(str(path), checkpoint_id="ckpt-a"))
    expected = trainer.state()
    target, state = fresh_target()
    dcp.load(state, storage_reader=TieredReader(path, checkpoint_id="ckpt-a"))
    target.restore(state)
    assert_same(expected, target.state())


def process_mode_worker(rank: int, world: int, configs: list[Config]) -> None:
    for config in configs:
        trainer = Trainer(seed=5)
        trainer.train(2)
        future = dcp.async_save(
            trainer.state(),
            storage_writer=TieredWriter(config),
            checkpoint_id="step_000002",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        future.result()
        assert restore_and_compare(config, "step_000002", trainer) == config.tiers[0].name


def test_async_save_in_process_mode_every_tier(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    configs = [make_config(kind) for kind in KINDS]
    run_ranks(process_mode_worker, 1, tmp_path, configs)


def test_tier_argument_writes_to_a_named_tier(make_config: Callable[..., Any]) -> None:
    config = make_config("memory", "s3")
    trainer = Trainer(seed=3)
    trainer.train(1)
    dcp.save(trainer.state(), storage_writer=TieredWriter(config, tier="s3"), checkpoint_id="final")
    assert restore_and_compare(config, "final", trainer) == "s3"
