"""``dcp.load(no_dist=True)`` on one rank of a multi-rank job (issue 22, row 10).

DCP tells a storage reader nothing of ``no_dist``: a reader that chooses its tier collectively waits
in a collective the other ranks never join, until the process group's timeout (30 min with gloo's
default). ``TieredReader(config, collective=False)`` chooses alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config


def rank_0_alone(rank: int, world: int, config: Config) -> None:
    """Rank 0 saves and loads by itself; rank 1 waits for it at a barrier."""
    if rank == 0:
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="solo", no_dist=True)
        target = {"w": torch.zeros(1000)}
        reader = TieredReader(config, collective=False)
        dcp.load(target, storage_reader=reader, checkpoint_id="solo", no_dist=True)
        assert torch.equal(target["w"], state["w"])
    dist.barrier()


def test_one_rank_loads_alone_with_no_dist(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "shared")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_ranks(rank_0_alone, 2, tmp_path, config)
        except BaseException as exc:  # noqa: BLE001 - judged by the test
            errors.append(exc)

    job = threading.Thread(target=run, daemon=True)
    job.start()
    job.join(timeout=120)
    assert not job.is_alive(), "the load waited for ranks that never join it"
    assert errors == []
