"""An adversarial review of the checkpoint manager: each test a reproduction of a problem found in it
(fixed in the same commit), with real tiers, real DCP saves and, across ranks, gloo on loopback."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.distributed_c10d as c10d

from tests.workers import run_ranks
from tierstore import CheckpointManager, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.dcp.manager import default_id
from tierstore.errors import ConfigError, InvalidCheckpointIdError, TierstoreError


def state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((256,), value)}}


def test_an_overlapped_writer_saves_what_the_state_was_when_maybe_save_returned(
    make_config: Callable[..., Config],
) -> None:
    """With ``overlap=True`` (or the config's ``staging.overlap``) ``dcp.async_save`` returns an
    ``AsyncSaveResponse``, not a future: the manager failed an assertion at the first save (and, run
    with ``python -O``, would have let the trainer modify the state while it was being copied)."""
    config = make_config("memory")
    trained = state(1.0)
    manager = CheckpointManager(config, trained, every_steps=1, overlap=True)
    assert manager.maybe_save(1) is True
    trained["model"]["w"].fill_(2.0)  # the next step: maybe_save has returned, the state may change
    manager.close()
    fresh = state(-1.0)
    again = CheckpointManager(config, fresh, every_steps=1)
    assert again.restore() == 1
    assert torch.equal(fresh["model"]["w"], torch.full((256,), 1.0))
    again.close()


@pytest.mark.parametrize(
    "when",
    [
        {"every_steps": -3},  # saved at every multiple of 3, as if 3
        {"every_steps": 0, "every_seconds": 60.0},  # ignored beside every_seconds
        {"every_steps": 2.5},  # a save at steps 5, 10, ...
        {"every_steps": True},
        {"every_steps": 5, "every_seconds": 0},  # a save at every step
        {"every_steps": 5, "every_seconds": -1.0},
        {"every_seconds": float("nan")},  # never a save
        {"mtbf": -3600.0},
        {"every_steps": 5, "mtbf": 0},
        {"every_steps": 5, "checkpoint_id": "step"},  # a TypeError at the first save
        {"every_steps": 5, "async_mode": "process"},  # needs torch.distributed: fails at the first save
    ],
)
def test_bad_arguments_are_refused_when_the_manager_is_made(
    make_config: Callable[..., Config], when: dict[str, Any]
) -> None:
    """Each was accepted silently and meant something else (or failed only at the first save)."""
    with pytest.raises(ConfigError, match="CheckpointManager"):
        CheckpointManager(make_config("memory"), state(0.0), **when)


@pytest.mark.parametrize("async_mode", ["thread", None])
def test_an_invalid_id_from_checkpoint_id_is_raised_at_the_save_not_told_as_a_failed_save(
    make_config: Callable[..., Config], async_mode: str | None
) -> None:
    """An id the function yields that no tier accepts is the caller's bug, the same at every save:
    it went to ``on_saved`` as a failed save (logged, and the run went on without a checkpoint)."""
    told: list[tuple[str, BaseException | None]] = []
    manager = CheckpointManager(
        make_config("memory"),
        state(0.0),
        every_steps=1,
        async_mode=async_mode,
        checkpoint_id=lambda step: f"../step{step}",
        on_saved=lambda checkpoint, error: told.append((checkpoint, error)),
    )
    with pytest.raises(InvalidCheckpointIdError, match="step1"):
        manager.maybe_save(1)
    manager.close()
    assert told == []


def test_stop_signals_that_cannot_all_be_watched_leave_no_handler_behind(
    make_config: Callable[..., Config],
) -> None:
    """SIGKILL cannot be caught: the manager was refused, and SIGUSR1, installed before it, stayed
    on the refused manager's handler (a pre-emption notice then went to an object nobody asks)."""
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(OSError):
        CheckpointManager(
            make_config("memory"), state(0.0), every_steps=1, stop_signals=(signal.SIGUSR1, signal.SIGKILL)
        )
    assert signal.getsignal(signal.SIGUSR1) is before


def managers_in_turn(rank: int, world: int, config: Config) -> None:
    groups = len(c10d._world.pg_map)
    for step in (1, 2, 3):
        manager = CheckpointManager(config, {"w": torch.full((16,), float(rank))}, every_steps=1)
        manager.maybe_save(step)
        manager.close()
    assert len(c10d._world.pg_map) == groups, (groups, len(c10d._world.pg_map))
    dist.barrier()


def test_close_destroys_the_process_groups_the_manager_made(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Each manager makes two gloo groups (sockets and threads on every rank); close() kept them,
    so a job (or a test suite, or an evaluation loop) that makes a manager per phase leaked two a time."""
    run_ranks(managers_in_turn, 2, tmp_path, make_config("memory"))


def test_a_closed_manager_refuses_to_save_and_closing_again_does_nothing(
    make_config: Callable[..., Config],
) -> None:
    """After close() a maybe_save saved anyway: through the writer whose staging buffers close()
    had released (allocated again, never released), with no stop signal watched and, across
    ranks, with no agreement (its groups are gone)."""
    config = make_config("memory")
    manager = CheckpointManager(config, state(1.0), every_steps=1)
    manager.maybe_save(1)
    manager.close()
    manager.close()  # twice: nothing more to do
    with pytest.raises(TierstoreError, match="closed"):
        manager.maybe_save(2)
    with pytest.raises(TierstoreError, match="closed"):
        manager.save_durable(2)
    with pytest.raises(TierstoreError, match="closed"):
        manager.close(2)  # a last save asked for: not silently skipped
    assert sorted(i for i in config.make_tier("memory", node=0).list_dir() if i.startswith("step_")) == [
        "step_00000001"
    ]


def test_a_failed_save_does_not_cost_the_durable_last_state_at_close(
    make_config: Callable[..., Config],
) -> None:
    """A periodic save failed (NaN at step 2, refused by check_finite); the run ended at step 3 with a
    finite state: close(3) raised step 2's failure first and never saved step 3 (nothing committed)."""
    config = make_config("memory", "local", promote={"every": 1000})
    trained = state(float("nan"))
    manager = CheckpointManager(config, trained, every_steps=2, check_finite=True)
    manager.maybe_save(2)
    trained["model"]["w"].fill_(3.0)
    with pytest.raises(BaseException, match=r"(?i)finite"):  # step 2's failure is still raised
        manager.close(3)
    assert latest_committed(config) == default_id(3)


def test_a_failed_save_does_not_cost_the_stop_save(make_config: Callable[..., Config]) -> None:
    """The same at a pre-emption: the stop save at step 3 was never made."""
    config = make_config("memory")
    trained = state(float("nan"))
    manager = CheckpointManager(config, trained, every_steps=2, check_finite=True)
    manager.maybe_save(2)
    trained["model"]["w"].fill_(3.0)
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(BaseException, match=r"(?i)finite"):
        manager.maybe_save(3)
    assert manager.should_stop
    assert latest_committed(config) == default_id(3)
    manager.close()


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_with_mtbf_the_first_save_measures_at_once_and_every_seconds_still_bounds_the_interval(
    make_config: Callable[..., Config],
) -> None:
    """ "Whichever comes first": beside a measured Daly interval (hours, with a long mtbf) the
    ``every_seconds`` bound was dropped, and the first save, "due at once to measure", waited for
    ``every_seconds``."""
    clock = Clock()
    manager = CheckpointManager(make_config("memory"), state(1.0), every_seconds=10.0, mtbf=1e9, clock=clock)
    assert manager.maybe_save(1) is True, "the first save measures the stall"
    manager.wait()
    assert manager.interval == 10.0
    clock.now += 11.0
    assert manager.maybe_save(2) is True, "every_seconds passed: due, whatever Daly says"
    manager.close()


def test_the_interval_measures_the_periodic_saves_only(make_config: Callable[..., Config]) -> None:
    """save_durable (a synchronous write into the slowest tier, after a rollback in train_gpt) went
    into the median of the stalls as if a periodic async save had cost the trainer that long."""
    clock = Clock()
    config = make_config("memory", "local", promote={"every": 1000})
    manager = CheckpointManager(config, state(1.0), mtbf=3600.0, clock=clock)
    manager.maybe_save(1)
    manager.wait()
    interval = manager.interval
    manager.save_durable(2)
    assert manager.interval == interval
    manager.close()


def test_restoring_a_checkpoint_without_the_managers_step_never_returns_a_made_up_step(
    make_config: Callable[..., Config],
) -> None:
    """A checkpoint saved by plain ``dcp.save`` + TieredWriter holds no step. With a load planner
    that allows a partial load (a caller's own, as train_gpt passes one) restore() returned -1, its
    placeholder: ``manager.restore() or 0`` then resumed the loop at step 0 minus one."""
    config = make_config("memory")
    dcp.save(state(3.0), storage_writer=TieredWriter(config), checkpoint_id=default_id(3))
    manager = CheckpointManager(
        config, state(0.0), every_steps=1, load_planner=dcp.DefaultLoadPlanner(allow_partial_load=True)
    )
    with pytest.raises(TierstoreError, match="no step"):
        manager.restore()
    manager.close()


def durable_end_refused(rank: int, world: int, config: Config) -> None:
    told: list[str] = []
    trained = {"w": torch.full((16,), float("nan"))}  # refused by check_finite at the durable save
    manager = CheckpointManager(
        config, trained, every_steps=100, check_finite=True, on_saved=lambda c, e: told.append(c)
    )
    try:
        manager.close(2)
        raised = False
    except TierstoreError:
        raised = True
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, raised)
    assert everyone == [True] * world, everyone
    assert told == [default_id(2)], told


def test_a_durable_save_that_failed_is_raised_on_every_rank(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """With ``on_saved`` a failed durable save is told on every rank, and then rank 0 alone found no
    marker and raised while the others returned as if the state were durable (a barrier after close
    hung them, or they exited 0 while rank 0 failed)."""
    run_ranks(durable_end_refused, 2, tmp_path, make_config("memory", "local", promote={"every": 1000}))
