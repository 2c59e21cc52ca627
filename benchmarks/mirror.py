"""Peer-mirrored host memory: what mirroring costs a save, and what it buys a restore.

Two ranks on two simulated nodes (one rank per node, a host name and a memory root under
``/dev/shm`` each), ``torch.multiprocessing`` with gloo on loopback, ``--mirror-size`` of state per
rank (distinct keys per rank: DCP saves each rank's own bytes; the workload's state is at least one
transformer block, about 150 MiB, whatever the size asked). Each part runs ``--reps`` counted
rounds after one uncounted warm-up round, its sides in an order rotated from round to round:

* **throughput**: a synchronous ``dcp.save`` into a mirrored memory tier, then ``wait_mirrored``;
  the exchange is timed inside the rank (the benchmark wraps ``rounds.run_round``, the whole round
  on the mirror thread from hand-off to the last marker, and ``rounds._exchange``, its file
  transfer) from the moment the last rank started to the moment the last rank ended; against plain
  ``dist.isend``/``dist.irecv`` of the same bytes in both directions on the default gloo group,
  from and into warm buffers, the fastest of 1, 4, 16, 64 and 256 MiB per message in each round;
* **stall**: ``dcp.async_save`` (THREAD) with a ``TieredWriter`` into a mirrored memory tier and
  into an unmirrored one, timed to its return (the stall) and to its commit, each save committed
  and mirrored before the next side; and **back to back**: a first save waited for to its commit
  only, then the timed save at once, while the first one's mirror exchange may still run (the
  report says in how many rounds it did). Stalls are the slower rank's; ``--gap`` seconds per GiB
  (at least ``--gap``) pass after each side;
* **restore after a lost node**: the same state saved once into a mirrored memory tier, a job-wide
  ``shared`` tier on disk and S3 (moto, the run's server); each round restores on both ranks from
  memory with node 1's memory root gone (node 1's shards come from node 0's mirror over the restore
  group), from intact memory, from the shared tier (page cache) and from S3. (A ``local`` tier is not
  a candidate: a node-local copy cannot serve a restore whose ranks span nodes.)

Ratios are medians of per-round ratios; the stall ratios have the feature's target, the rest are
reported. Every exchange must end mirrored (its status record says so) and every restore must read
the expected tier and the saved bytes: otherwise the phase fails rather than report a figure.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.mirror_rank import MirrorJob, Rank, RoundClock
from benchmarks.mirror_restore import measure_restores
from benchmarks.mirror_saves import measure_stalls, measure_throughput
from benchmarks.phase import Bench
from benchmarks.tables import figure_table, ratio_table
from benchmarks.workload import model_state, quiet_warnings, state_bytes, tensors_of
from tierstore import TieredWriter
from tierstore.topology import HOST_VARIABLE
from tierstore.units import parse_size

TARGETS = {
    "stall with mirror / without (THREAD)": ("<=", 1.05),
    "stall, previous mirror still running / without mirror (THREAD)": ("<=", 1.05),
}
"""The targets of the mirror phase (bench.py merges them with its own)."""

WORLD = 2
PREFIX = "mirror-restore"
"""Where in the run's bucket the S3 copy goes (removed after the phase)."""


def phase_mirror(bench: Bench) -> None:
    """Spawn the ranks, wait for them (failing on a hang), and record their figures in ``bench``."""
    size = parse_size(bench.args.mirror_size)
    reps = bench.args.reps
    print(
        f"peer mirror ({WORLD} ranks on {WORLD} simulated nodes, --mirror-size {size / 2**20:.0f} MiB;"
        f" rounds of: mirror exchange vs plain gloo, async_save stall with and without mirroring,"
        f" restores with node 1 lost)",
        flush=True,
    )
    job = MirrorJob(
        size,
        reps,
        bench.args.gap,
        shm=str(bench.shm / "mirror"),
        disk=str(bench.disk / "mirror"),
        endpoint=bench.endpoint,
        bucket=bench.bucket,
        prefix=PREFIX,
        result=str(bench.disk / "mirror-result.json"),
    )
    store = bench.disk / f"mirror-store-{os.urandom(4).hex()}"
    limit = 900 + 120 * (reps + 1) * max(1.0, size / 2**28)
    try:
        run_ranks(job, str(store), limit)
        found = json.loads(Path(job.result).read_text())
    finally:
        shutil.rmtree(job.shm, ignore_errors=True)
        shutil.rmtree(job.disk, ignore_errors=True)
        _empty_prefix(bench)
    for name, figure in found["samples"].items():
        for seconds in figure["seconds"]:
            bench.sample(name, seconds, figure["nbytes"])
    for name, ratios in found["pairs"].items():
        for ratio in ratios:
            bench.pair(name, ratio)
    bench.extra["mirror"] = {
        "size": bench.args.mirror_size,
        "figures": list(found["samples"]),
        "ratios": list(found["pairs"]),
        **found["extra"],
    }
    bench.show(*found["samples"])


def run_ranks(job: MirrorJob, store: str, limit_s: float) -> None:
    """Run both ranks; raise if one fails or they are not done within ``limit_s`` (a hang)."""
    context = mp.start_processes(
        _rank_main, args=(job, store), nprocs=WORLD, join=False, start_method="spawn"
    )
    assert context is not None
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise RuntimeError(f"peer mirror ranks still running after {limit_s:.0f}s (hung?)")


def _rank_main(rank: int, job: MirrorJob, store: str) -> None:
    """A spawned rank: join the gloo group as node ``rank`` on a host of its own, measure."""
    os.environ[HOST_VARIABLE] = f"sim-host-{rank}"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    logging.basicConfig(level=logging.WARNING)  # tierstore says when a mirror fails
    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        with quiet_warnings():
            _measure(rank, job)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(rank: int, job: MirrorJob) -> None:
    state = {f"rank{rank}": model_state(job.size, seed=rank)}
    r = Rank(job, rank, state, RoundClock())
    r.extra["state bytes per rank"] = state_bytes(state)
    count = len(list(tensors_of(state)))
    r.say(f"state: {state_bytes(state) / 2**20:.0f} MiB per rank in {count} tensors")
    mirrored = TieredWriter(r.memory("saves", mirror=True), node=rank)
    unmirrored = TieredWriter(r.memory("unmirrored", mirror=False), node=rank)
    measure_throughput(r, mirrored)
    measure_stalls(r, mirrored, unmirrored)
    mirrored.close()
    unmirrored.close()
    dist.barrier()
    if rank == 0:  # free the tmpfs before the restores
        shutil.rmtree(f"{job.shm}/saves", ignore_errors=True)
        shutil.rmtree(f"{job.shm}/unmirrored", ignore_errors=True)
    measure_restores(r)
    if rank == 0:
        found = {"samples": r.samples, "pairs": r.pairs, "extra": r.extra}
        Path(job.result).write_text(json.dumps(found, indent=1))


def _empty_prefix(bench: Bench) -> None:
    """Remove the phase's S3 copy from the server (it holds objects in this process's memory)."""
    pages = bench.s3.get_paginator("list_objects_v2").paginate(Bucket=bench.bucket, Prefix=PREFIX)
    for page in pages:
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            bench.s3.delete_objects(Bucket=bench.bucket, Delete={"Objects": keys})


def markdown(report: dict[str, Any]) -> str:
    """The phase's own tables (figures, then ratios) for docs/performance.md."""

    found = report["extra"]["mirror"]
    overlapped = found.get("back to back: previous mirror still running at the timed save (per round)", [])
    lines = [
        f"Peer mirror: {WORLD} ranks on {WORLD} simulated nodes,"
        f" {found['state bytes per rank'] / 2**20:.0f} MiB of state per rank;"
        f" back to back, the previous mirror was still running in {sum(overlapped)} of"
        f" {len(overlapped)} rounds.",
        "",
        *figure_table(report, found["figures"]),
        "",
        *ratio_table(report, found["ratios"]),
    ]
    return "\n".join(lines)
