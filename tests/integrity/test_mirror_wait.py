"""``wait_mirrored`` and ``close`` in PROCESS mode after overwrites of one id (issue 22, row 9).

Two ``overwrite=True`` async saves of one id in ``AsyncCheckpointerType.PROCESS`` mode, on a mirrored
memory tier, 2 ranks on 2 simulated nodes. The exchanges run in DCP's checkpoint process; the trainer
used to count the status records they leave under the generation directories, and the second save
removed the first generation, record included: ``wait_mirrored()`` never returned, and ``close()``
waited the whole ``mirror.timeout``, then warned that an exchange was still running. Each job here runs
under a hard deadline, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tests.mirror_jobs import become, memory_root, mirror_config, shard_state
from tests.workers import _entry, _RankCall
from tierstore import TieredWriter
from tierstore.config import Config

ID = "latest"
MIRROR_TIMEOUT = 30.0
"""``mirror.timeout`` of the jobs: the old ``close()`` waited this long before its false warning."""
DEADLINE = 90.0
"""Hard limit of a whole job (two saves, their exchanges, the waits): far above a passing run."""
STILL_RUNNING = "closing with a peer-mirror exchange still running"


class _Warnings(logging.Handler):
    """Collects the writer's warnings in a rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _two_overwrites(rank: int, config: Config, root: Path) -> TieredWriter:
    """Rank ``rank`` (on node ``rank``) saves ``latest`` twice in PROCESS mode, the second save
    replacing the first. The first exchange ends (its status record is there) before the second
    save commits: the overwrite then removes the first generation, status record included (when an
    exchange ends later, its record lands after the removal and the old count happened to work)."""
    become(rank)
    writer = TieredWriter(config, node=rank, overwrite=True)
    for step in (1, 2):
        dcp.async_save(
            shard_state(rank, step),
            storage_writer=writer,
            checkpoint_id=ID,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()
        if step == 1:
            _wait_for_a_status_record(root, rank)
    return writer


def _wait_for_a_status_record(root: Path, node: int) -> None:
    """Until the exchange of the first save has ended on ``node`` (its status record is there)."""
    deadline = time.monotonic() + MIRROR_TIMEOUT
    while not list(memory_root(root, node).glob(f"{ID}/*/mirror/node{node:05d}.json")):
        assert time.monotonic() < deadline, "the first save's exchange did not end"
        time.sleep(0.05)


def _current_status(root: Path, node: int) -> dict[str, object]:
    """This node's mirror status record of the generation the commit marker names now (the marker
    is on the coordinator's node, node 0)."""
    marker = json.loads((memory_root(root, 0) / ID / "commit.json").read_text())
    generation = marker["generation"]
    path = memory_root(root, node) / ID / generation / "mirror" / f"node{node:05d}.json"
    return dict(json.loads(path.read_text()))


def wait_then_close(rank: int, world: int, config: Config, root: Path) -> None:
    """``wait_mirrored()`` without a timeout returns, after both exchanges ended; ``close()`` then
    neither waits nor warns."""
    writer = _two_overwrites(rank, config, root)
    warnings = _Warnings()
    logging.getLogger("tierstore.dcp.writer").addHandler(warnings)
    assert writer.wait_mirrored() is True
    # It returned because the exchanges ended, not early: the last one left its status record.
    assert _current_status(root, rank)["mirrored"] is True, _current_status(root, rank)
    started = time.monotonic()
    writer.close()
    assert time.monotonic() - started < MIRROR_TIMEOUT / 2
    assert not [m for m in warnings.messages if STILL_RUNNING in m], warnings.messages


def close_only(rank: int, world: int, config: Config, root: Path) -> None:
    """``close()`` alone waits for both exchanges, not for ``mirror.timeout``, and does not warn."""
    writer = _two_overwrites(rank, config, root)
    warnings = _Warnings()
    logging.getLogger("tierstore.dcp.writer").addHandler(warnings)
    started = time.monotonic()
    writer.close()
    waited = time.monotonic() - started
    assert not [m for m in warnings.messages if STILL_RUNNING in m], (waited, warnings.messages)
    assert waited < MIRROR_TIMEOUT, waited
    assert _current_status(root, rank)["mirrored"] is True, _current_status(root, rank)


def _run_with_deadline(function: Callable[..., None], world: int, tmp: Path, *args: object) -> None:
    """``run_ranks``, but a job still running after ``DEADLINE`` seconds is killed and fails."""
    call = _RankCall(function, world, str(tmp / f"store-{os.urandom(4).hex()}"), args, dict(os.environ))
    context = mp.start_processes(_entry, args=(call,), nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + DEADLINE
    while not context.join(timeout=1.0):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
                process.join()
            pytest.fail(f"the job did not end within {DEADLINE:.0f}s: wait_mirrored/close hung")


def _leftover_records(root: Path) -> list[Path]:
    """What the writers' waits left in any node's memory: their completion records (and the
    directory each process keeps them in) are removed by ``close()``."""
    return sorted(p for n in (0, 1) for p in memory_root(root, n).glob(".tierstore/mirror-ended/*"))


@pytest.mark.timeout(DEADLINE + 60)
def test_wait_mirrored_returns_after_two_overwrite_saves_in_process_mode(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), timeout=f"{MIRROR_TIMEOUT:.0f}s")
    _run_with_deadline(wait_then_close, 2, tmp_path, config, tmp_path)
    assert _leftover_records(tmp_path) == []


@pytest.mark.timeout(DEADLINE + 60)
def test_close_after_two_overwrite_saves_in_process_mode_does_not_warn(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), timeout=f"{MIRROR_TIMEOUT:.0f}s")
    _run_with_deadline(close_only, 2, tmp_path, config, tmp_path)
    assert _leftover_records(tmp_path) == []
