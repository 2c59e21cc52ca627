"""The restoring side of the peer-mirror benchmark: a lost node's restore from its partner's memory,
next to the same restore from a job-wide disk tier and from S3, and from intact memory.

The same state is saved once into each of: a mirrored memory tier, a ``shared`` tier on this
machine's disk (page cache: the files were just written) and S3 (moto). A ``local`` tier would be
the natural disk baseline, but a node-local copy cannot serve a restore whose ranks span nodes
(docs/design.md), so the disk figure is the job-wide tier a multi-node job restores from. Then each
round restores all four ways, in a rotating order, on both ranks: node 1 "lost" means its memory
root is moved aside (instant, on one tmpfs) for the restore and put back after it, so every round
starts from the same files.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from benchmarks.mirror_rank import Rank, check_mirrored, wait_mirrored
from benchmarks.workload import tensors_of, zeros_like_state
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config

LOST = 1
"""The node whose host memory is lost."""


def measure_restores(r: Rank) -> None:
    """Save once into each tier, then rounds of restores (see the module docstring)."""
    memory = r.memory("restore", mirror=True)
    shared, s3 = r.lower("shared"), r.lower("s3")
    checkpoint_id = "restore_000001"
    writer = TieredWriter(memory, node=r.rank)
    dcp.save(r.state, storage_writer=writer, checkpoint_id=checkpoint_id)
    wait_mirrored(r, writer, checkpoint_id)
    check_mirrored(r, writer, checkpoint_id)
    for config in (shared, s3):
        dcp.save(r.state, storage_writer=TieredWriter(config, node=r.rank), checkpoint_id=checkpoint_id)
    lost_root = Path(f"{r.job.shm}/restore/mem/{LOST}")
    target = zeros_like_state(r.state)
    sides: dict[str, tuple[Config, str, bool]] = {
        "memory, node 1 lost (peer mirror)": (memory, "memory", True),
        "memory, both nodes intact": (memory, "memory", False),
        "shared tier (disk, page cache)": (shared, "shared", False),
        "s3 (moto)": (s3, "s3", False),
    }
    names = list(sides)
    for index in range(r.job.reps + 1):  # round 0 touches the target's memory: not counted
        seconds: dict[str, float] = {}
        for shift in range(len(names)):
            name = names[(index + shift) % len(names)]
            config, tier, lose = sides[name]
            if not index:
                for tensor in tensors_of(target):
                    tensor.zero_()
            seconds[name] = r.slowest(
                restore(r, config, checkpoint_id, target, tier=tier, lost=lost_root if lose else None)
            )
            if not index:
                check_equal(target, r.state, name)
        if not index:
            continue
        for name, value in seconds.items():
            r.sample(f"restore of both ranks, {name}", value, r.total_bytes)
        mirror = seconds[names[0]]
        r.pair("lost-node restore: peer mirror / shared disk tier (bandwidth)", seconds[names[2]] / mirror)
        r.pair("lost-node restore: peer mirror / s3 (bandwidth)", seconds[names[3]] / mirror)
        r.pair("lost-node restore: peer mirror / intact memory (bandwidth)", seconds[names[1]] / mirror)
    r.say("restores done")


def restore(
    r: Rank, config: Config, checkpoint_id: str, target: Any, *, tier: str, lost: Path | None
) -> float:
    """One ``dcp.load`` on this rank, timed; with ``lost``, that node's memory root is moved aside
    first (on its own rank) and put back after. Checks the tier the reader chose."""
    aside = lost.with_name(f"{lost.name}.aside") if lost is not None else None
    if lost is not None and aside is not None and r.rank == LOST:
        lost.rename(aside)
    dist.barrier()
    reader = TieredReader(config, node=r.rank)
    started = time.perf_counter()
    dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
    seconds = time.perf_counter() - started
    dist.barrier()
    if lost is not None and aside is not None and r.rank == LOST:
        shutil.rmtree(lost, ignore_errors=True)  # what the restore left in the empty root
        aside.rename(lost)
    if reader.chosen_tier != tier:
        raise RuntimeError(f"rank {r.rank}: restore read {reader.chosen_tier}, not {tier}")
    return seconds


def check_equal(restored: Any, saved: Any, what: str) -> None:
    """Bit-exact, or the restore measured the wrong thing."""
    for got, want in zip(tensors_of(restored), tensors_of(saved), strict=True):
        if not torch.equal(got, want):
            raise RuntimeError(f"restore from {what}: a tensor differs from the saved state")
