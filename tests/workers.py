"""Multi-process helpers: each function runs in a spawned process (gloo on loopback)."""

from __future__ import annotations

import atexit
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def init_group(rank: int, world: int, store: str) -> None:
    """Join a gloo group rendezvousing through a file (no port races)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


# Ranks fork from a server that imported torch and tierstore once per test session: a spawned rank
# spends 3-4 s of CPU importing them, which on two cores was a third of the suite. Each rank still
# starts as a fresh process (no state of the test process is inherited); the test's environment,
# which a forked server does not follow, travels with the call.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "tierstore.dcp.save.writer",
    "tierstore.dcp.restore.reader",
    "tests.workers",
]
mp.set_forkserver_preload(FORKSERVER_PRELOAD)


def run_ranks(function: Callable[..., None], world: int, tmp: Path, *args: Any) -> None:
    """Start ``world`` processes running ``function(rank, world, store, *args)``; raise on failure."""
    call = _RankCall(function, world, str(tmp / f"store-{os.urandom(4).hex()}"), args, dict(os.environ))
    mp.start_processes(_entry, args=(call,), nprocs=world, join=True, start_method="forkserver")


class _RankCall(NamedTuple):
    function: Callable[..., None]
    world: int
    store: str
    args: tuple[Any, ...]
    env: dict[str, str]


def _entry(rank: int, call: _RankCall) -> None:
    os.environ.clear()
    os.environ.update(call.env)
    init_group(rank, call.world, call.store)
    try:
        call.function(rank, call.world, *call.args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        # A forked rank ends in os._exit, which skips exit handlers; a torchrun worker runs them
        # (weakref finalisers that release activity records and staging buffers), so run them here.
        atexit._run_exitfuncs()
