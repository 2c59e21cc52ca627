"""A replicated state (data parallel: every rank holds all of it) is stored once, not once per rank.

Each rank stages its whole state before DCP's planner decides who writes what; a rank that writes
only part of its slab stores that part in a compact file and keeps the slab for the next save.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config, config_from_dict
from tierstore.ids import staging_dir
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

STATE_BYTES = 8 * 2**20


def replicated(step: int) -> dict[str, torch.Tensor]:
    """The same 8 MiB on every rank, as data parallelism keeps it."""
    return {f"layer{i}": torch.full((2**18,), float(step * 10 + i)) for i in range(8)}


def save_three(rank: int, world: int, config: Config) -> None:
    writer = TieredWriter(config)
    for step in range(3):
        dcp.async_save(replicated(step), storage_writer=writer, checkpoint_id=f"step_{step}").result()
    dist.barrier()
    writer.close()


def test_each_item_of_a_replicated_state_is_stored_once_and_loads_back(tmp_path: Path) -> None:
    config = config_from_dict({"tiers": [{"name": "ram", "type": "memory", "path": str(tmp_path / "ram")}]})
    run_ranks(save_three, 2, tmp_path, config)

    ram = config.make_tier("ram", node=0)
    for step in range(3):
        manifest = read_manifest(ram, f"step_{step}", trust=MarkerTrust())
        stored = sum(f.size for f in manifest.files if f.rank is not None)
        assert stored < 1.1 * STATE_BYTES, f"step_{step}: {stored} bytes stored for {STATE_BYTES}"
        loaded: dict[str, Any] = {k: torch.zeros_like(v) for k, v in replicated(0).items()}
        dcp.load(loaded, storage_reader=TieredReader(config), checkpoint_id=f"step_{step}")
        for key, value in replicated(step).items():
            assert torch.equal(loaded[key], value), key
    slabs = list(Path(ram.local_path(staging_dir())).rglob("slab-*.bin"))
    assert slabs == [], f"slabs left after close: {slabs}"
