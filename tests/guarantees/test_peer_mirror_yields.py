"""The mirror exchange yields to this process's staging: between chunks it pauses while a staging
copy of its process runs, in both directions, for a bounded time, and resumes after
(``tierstore/dcp/mirror/rounds.py``, ``tierstore/dcp/staging/now.py``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.mirror_jobs import become, memory_root, mirror_config, mirror_markers
from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.dcp.staging.now import STAGING_NOW

MIB = 2**20
SIZE = 160 * MIB
"""Bytes of state per rank: ten chunks each way, more than a receiver posts ahead."""


def state_of(rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank + 1)
    return {f"blob{rank}": torch.randint(1, 256, (SIZE,), dtype=torch.uint8, generator=generator)}


def landed(root: Path, checkpoint_id: str) -> int:
    """Bytes of ``checkpoint_id``'s mirror data that have reached any node's memory tier so far
    (MiB blocks of the files received, landing or renamed, that are no longer all zeros: the
    state has no zero byte, a landing file's reserved pages are zeros)."""
    total = 0
    for node in (0, 1):
        for path in memory_root(root, node).glob(f".tierstore/mirror/{checkpoint_id}/*/*"):
            if ".distcp" not in path.name:
                continue
            data = np.fromfile(path, dtype=np.uint8)
            blocks = data[: data.size // MIB * MIB].reshape(-1, MIB)
            total += int(blocks.any(axis=1).sum()) * MIB
    return total


def exchange_while_rank0_stages(rank: int, world: int, config: Config, root: Path) -> None:
    """Rank 0 holds a staging copy open across a save and its exchange: no byte of the exchange
    lands anywhere meanwhile, and the exchange ends, mirrored, once the copy is over."""
    become(rank)
    writer = TieredWriter(config, node=rank)
    state = state_of(rank)
    staging = STAGING_NOW.get().held()
    if rank == 0:
        staging.__enter__()
    dist.barrier()
    dcp.save(state, storage_writer=writer, checkpoint_id="step_1")
    if rank == 0:
        time.sleep(1.0)  # the chunks in flight when it paused have landed by now
        before = landed(root, "step_1")
        time.sleep(2.0)
        after = landed(root, "step_1")
        ended = writer.wait_mirrored(0)
        released = time.monotonic()
        staging.__exit__(None, None, None)
        assert not ended, "the exchange ran to its end while this process was staging"
        assert after == before, f"{after - before} bytes landed while this process was staging"
        assert after < 2 * SIZE, "everything had landed"
        assert writer.wait_mirrored(60), "the exchange did not resume after the staging"
        print(f"resumed and ended {time.monotonic() - released:.2f}s after the staging ended")
    else:
        assert writer.wait_mirrored(60)
    dist.barrier()
    for node in (0, 1):
        assert len(mirror_markers(root, node, "step_1")) == 1
    assert landed(root, "step_1") == 2 * SIZE
    writer.close()
    dist.barrier()


def test_the_exchange_makes_no_progress_while_this_process_stages_and_resumes_after(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), keep=2)
    run_ranks(exchange_while_rank0_stages, 2, tmp_path, config, tmp_path)


def exchange_while_both_stage_for_ever(rank: int, world: int, config: Config) -> None:
    """Both ranks hold a staging copy open and never end it: each pause is bounded (a quarter of
    the mirror's 8 s timeout), so the exchange still ends, mirrored, and the pair never hangs."""
    become(rank)
    writer = TieredWriter(config, node=rank)
    with STAGING_NOW.get().held():
        dist.barrier()
        started = time.monotonic()
        dcp.save(state_of(rank), storage_writer=writer, checkpoint_id="step_1")
        assert writer.wait_mirrored(30), "the exchange hung while both ranks were staging"
        took = time.monotonic() - started
        # The receiving thread takes no chunk before its budget is spent: 2 s of pauses.
        assert took >= 2.0, f"the exchange ended after {took:.2f}s: it never paused"
    dist.barrier()
    writer.close()


def test_a_pause_for_staging_is_bounded_and_two_paused_peers_never_hang(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), keep=2, timeout=8)
    run_ranks(exchange_while_both_stage_for_ever, 2, tmp_path, config)
    for node in (0, 1):
        assert len(mirror_markers(tmp_path, node, "step_1")) == 1


def test_staging_says_so_while_it_copies_and_only_then(tmp_path: Path) -> None:
    """The stager holds :data:`STAGING_NOW` during its copy of the state (the signal the exchange
    waits on), and lets it go when ``stage()`` returns."""
    config = mirror_config(tmp_path, lower=(), keep=2)
    writer = TieredWriter(config, node=0)
    state = {"big": torch.ones(96 * MIB, dtype=torch.float32)}
    seen: list[bool] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(STAGING_NOW.get().active)

    watcher = threading.Thread(target=watch)
    assert not STAGING_NOW.get().active
    watcher.start()
    try:
        for _ in range(2):  # the first save copies into fresh memory, the next into a slab
            writer.stage(state)  # dropped: nothing holds it, the next stage need not wait
    finally:
        done.set()
        watcher.join()
    assert any(seen), "no staging copy was ever said to run"
    assert not STAGING_NOW.get().active
    writer.close()
