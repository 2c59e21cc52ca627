"""Multi-process helpers: each function runs in a spawned process (gloo on loopback)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def init_group(rank: int, world: int, store: str) -> None:
    """Join a gloo group rendezvousing through a file (no port races)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def run_ranks(function: Callable[..., None], world: int, tmp: Path, *args: Any) -> None:
    """Spawn ``world`` processes running ``function(rank, world, store, *args)``; raise on failure."""
    store = str(tmp / f"store-{os.urandom(4).hex()}")
    mp.spawn(_entry, args=(function, world, store, args), nprocs=world, join=True)


def _entry(rank: int, function: Callable[..., None], world: int, store: str, args: Any) -> None:
    init_group(rank, world, store)
    try:
        function(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
