"""The checkpoint manager: when it saves, resuming, a stop signal, the durable final save, and an
interval that adapts to the stalls it measured."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.workers import run_ranks
from tierstore import CheckpointManager, latest_committed
from tierstore.config import Config
from tierstore.dcp.manager import default_id
from tierstore.errors import ConfigError
from tierstore.interval import daly
from tierstore.records.marker import read_manifest


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((256,), value)}}


def ids(config: Config, tier: str) -> list[str]:
    return sorted(i for i in config.make_tier(tier, node=0).list_dir() if i.startswith("step_"))


def test_saves_every_n_steps_and_resumes_the_newest_with_its_step(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local")
    trained = state(0.0)
    manager = CheckpointManager(config, trained, every_steps=3)
    saved = []
    for step in range(1, 8):
        trained["model"]["w"].fill_(float(step))
        saved.append(manager.maybe_save(step))
    manager.close()
    assert saved == [False, False, True, False, False, True, False]
    assert ids(config, "memory") == [default_id(3), default_id(6)]
    fresh = state(-1.0)
    resumed = CheckpointManager(config, fresh, every_steps=3)
    assert resumed.restore() == 6
    assert torch.equal(fresh["model"]["w"], torch.full((256,), 6.0))
    resumed.close()


def test_a_fresh_run_restores_nothing(make_config: Callable[..., Config]) -> None:
    manager = CheckpointManager(make_config("memory"), state(0.0), every_steps=1)
    assert manager.restore() is None
    manager.close()


def test_close_makes_the_last_state_durable_in_the_last_tier(make_config: Callable[..., Config]) -> None:
    """The promoter copies only every k-th commit to the last tier: the final one is written there."""
    config = make_config("memory", "local", promote={"every": 1000})
    trained = state(0.0)
    manager = CheckpointManager(config, trained, every_steps=2)
    for step in range(1, 6):
        trained["model"]["w"].fill_(float(step))
        manager.maybe_save(step)
    manager.close(5)
    assert read_manifest(
        config.make_tier("local", node=0), default_id(5), trust=config.marker_trust()
    ).checkpoint_id == default_id(5)
    assert latest_committed(config) == default_id(5)
    fresh = state(-1.0)
    again = CheckpointManager(config, fresh, every_steps=2)
    assert again.restore() == 5 and torch.equal(fresh["model"]["w"], torch.full((256,), 5.0))
    again.close()


def test_close_not_durable_saves_an_unsaved_last_step_in_the_fastest_tier_only(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("memory", "local", promote={"every": 1000})
    manager = CheckpointManager(config, state(0.0), every_steps=2)
    for step in range(1, 4):
        manager.maybe_save(step)
    manager.close(3, durable=False)
    assert ids(config, "memory") == [default_id(2), default_id(3)] and ids(config, "local") == []
    again = CheckpointManager(config, state(0.0), every_steps=2)
    again.restore()
    again.maybe_save(4)
    again.close(4, durable=False)  # committed by maybe_save: saving the id again would be refused (it exists)
    assert ids(config, "memory")[-1] == default_id(4)


def test_a_stop_signal_saves_at_the_next_step_and_stops(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    manager = CheckpointManager(config, state(1.0), every_steps=100)
    assert manager.maybe_save(1) is False and not manager.should_stop
    os.kill(os.getpid(), signal.SIGUSR1)  # a pre-emption notice
    assert manager.maybe_save(2) is True and manager.should_stop
    assert ids(config, "memory") == [default_id(2)], "saved synchronously, before maybe_save returned"
    manager.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, "the handler is put back at close"


def test_the_interval_follows_the_measured_stall(make_config: Callable[..., Config]) -> None:
    """With ``mtbf`` the manager saves at Daly's interval of the stalls it measured, not on a guess."""
    clock = Clock()
    manager = CheckpointManager(make_config("memory"), state(1.0), mtbf=3600.0, clock=clock)
    assert manager.maybe_save(1) is True, "the first save measures the stall"
    manager.wait()
    interval = manager.interval
    assert interval is not None and interval == daly(manager._stalls[0], 3600.0)
    clock.now += interval * 0.9
    assert manager.maybe_save(2) is False
    clock.now += interval * 0.2
    assert manager.maybe_save(3) is True
    manager.close()


def test_a_failed_save_is_raised_at_the_next_save_not_lost(make_config: Callable[..., Config]) -> None:
    manager = CheckpointManager(
        make_config("memory"), state(1.0), every_steps=1, commit_gate=lambda _v: "veto"
    )
    manager.maybe_save(1)
    with pytest.raises(BaseException, match="veto"):
        manager.maybe_save(2)
    manager.close()


def test_it_needs_to_know_when_to_save(make_config: Callable[..., Config]) -> None:
    with pytest.raises(ConfigError, match="every_steps, every_seconds or mtbf"):
        CheckpointManager(make_config("memory"), state(0.0))


def signalled_rank(rank: int, world: int, config: Config) -> None:
    """Rank 1 alone gets SIGTERM after step 3: both ranks save step 4 and stop there."""
    trained = {"model": {"w": torch.full((64,), float(rank))}}
    manager = CheckpointManager(config, trained, every_steps=100, async_mode="thread")
    step = 0
    while not manager.should_stop and step < 20:
        step += 1
        if rank == 1 and step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        manager.maybe_save(step)
    manager.close(step)
    assert step == 4, step
    dist.barrier()


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", "local", promote={"every": 1000})
    run_ranks(signalled_rank, 2, tmp_path, config)
    assert ids(config, "memory") == [default_id(4)]
    assert (
        read_manifest(
            config.make_tier("local", node=0), default_id(4), trust=config.marker_trust()
        ).world_size
        == 2
    )


def overlapping_rank(rank: int, world: int, config: Config) -> None:
    """A save every step, each still writing when the next step's agreement runs."""
    trained = {"model": {"w": torch.full((1 << 20,), float(rank))}}
    manager = CheckpointManager(config, trained, every_steps=1, async_mode="thread")
    for step in range(1, 7):
        trained["model"]["w"].add_(1.0)
        manager.maybe_save(step)
    manager.close()
    dist.barrier()


def test_the_agreement_does_not_share_a_group_with_the_save_in_flight(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """On one group, the agreement's all-reduce meets the async save's collectives from the
    other thread and both ranks hang (found by examples/train_gpt.py)."""
    config = make_config("memory", promote={"every": 1000})
    run_ranks(overlapping_rank, 2, tmp_path, config)
    assert ids(config, "memory")[-1] == default_id(6)


def process_mode_saves(rank: int, world: int, config: Config) -> None:
    trained = {"model": {"w": torch.full((64,), 0.0)}}
    manager = CheckpointManager(config, trained, every_steps=1, async_mode="process")
    for step in (1, 2, 3):
        trained["model"]["w"].fill_(float(step))
        manager.maybe_save(step)
    manager.close()


def test_process_mode_saves_one_after_another(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    """DCP's PROCESS checkpointer pickles the writer: the future's owner's record of the last staged
    save (over_when's) holds locks, and stays with the trainer (its pickling failed every save)."""
    config = make_config("memory", promote={"every": 1000})
    run_ranks(process_mode_saves, 1, tmp_path, config)
    assert ids(config, "memory") == [default_id(1), default_id(2), default_id(3)]
