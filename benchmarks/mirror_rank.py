"""What each rank of the peer-mirror benchmark runs (:mod:`benchmarks.mirror` spawns them).

One rank per simulated node: rank ``r`` is node ``r`` with a host name of its own
(``TIERSTORE_HOST=sim-host-r``) and memory tiers of its own under ``/dev/shm``. Every figure is
measured on both ranks and reduced on the default gloo group; rank 0 keeps the results.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.workload import state_bytes
from tierstore import TieredWriter
from tierstore.config import Config, config_from_dict
from tierstore.dcp.mirror import rounds
from tierstore.records.mirror import read_status

WAIT_S = 300.0
"""How long a rank waits for a mirror exchange before it calls the exchange hung."""


@dataclass(frozen=True)
class MirrorJob:
    """Everything a rank needs (picklable: ``torch.multiprocessing`` passes it to the ranks)."""

    size: int
    reps: int
    gap: float
    shm: str
    disk: str
    endpoint: str
    bucket: str
    prefix: str
    result: str


@dataclass(frozen=True)
class RoundTiming:
    """One mirror round on this rank (``time.monotonic``: one clock for every process of a host)."""

    checkpoint_id: str
    generation: str
    nbytes: int
    started: float
    ended: float
    transfer: tuple[float, float] | None
    """The file-transfer step alone (``rounds._exchange``), when the round got that far."""


class RoundClock:
    """Times every mirror round this process runs, by wrapping ``rounds.run_round`` (the whole
    round, run on the mirror thread) and ``rounds._exchange`` (its file-transfer step).

    Replaces both module functions for the rest of the process: build one per spawned rank only.
    """

    def __init__(self) -> None:
        self.timings: dict[str, RoundTiming] = {}
        self._transfers: dict[str, tuple[float, float]] = {}
        run_round, exchange = rounds.run_round, rounds._exchange

        def timed_round(round_: rounds.Round) -> None:
            started = time.monotonic()
            try:
                run_round(round_)
            finally:
                share = round_.share
                self.timings[share.checkpoint_id] = RoundTiming(
                    share.checkpoint_id,
                    share.generation,
                    sum(f.size for f in share.files),
                    started,
                    time.monotonic(),
                    self._transfers.pop(share.checkpoint_id, None),
                )

        def timed_exchange(state: Any) -> dict[int, str]:
            started = time.monotonic()
            try:
                return exchange(state)
            finally:
                ckpt = state.round_.share.checkpoint_id
                self._transfers[ckpt] = (started, time.monotonic())

        rounds.run_round = timed_round
        rounds._exchange = timed_exchange


@dataclass
class Rank:
    """This rank's view of the run: its state, its configurations, and the figures (rank 0's count)."""

    job: MirrorJob
    rank: int
    state: dict[str, Any]
    clock: RoundClock
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    pairs: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    count: int = 0

    @property
    def total_bytes(self) -> int:
        """Both ranks' state bytes (what a restore of both ranks moves)."""
        return 2 * state_bytes(self.state)

    def memory(self, name: str, *, mirror: bool) -> Config:
        """A memory tier under ``/dev/shm`` with one root per node, mirrored or not."""
        tier: dict[str, Any] = {
            "name": "memory",
            "type": "memory",
            "keep": 1,
            "path": f"{self.job.shm}/{name}/mem/{{node}}",
        }
        if mirror:
            tier["mirror"] = {"timeout": WAIT_S}
        return config_from_dict({"tiers": [tier]}, check_paths=False)

    def lower(self, kind: str) -> Config:
        """A job-wide tier on this machine's disk, or the S3 tier of the embedded server.

        (A ``local`` tier cannot serve a restore whose ranks span nodes: a node-local copy serves
        only its own node, docs/design.md. The disk baseline is therefore a ``shared`` tier.)
        """
        if kind == "shared":
            tier = {"name": "shared", "type": "shared", "path": f"{self.job.disk}/shared"}
        else:
            tier = {
                "name": "s3",
                "type": "s3",
                "endpoint_url": self.job.endpoint,
                "url": f"s3://{self.job.bucket}/{self.job.prefix}",
            }
        return config_from_dict({"tiers": [tier]}, check_paths=False)

    def next_id(self) -> str:
        """A fresh checkpoint id (ids are never reused within the run)."""
        self.count += 1
        return f"step_{self.count:06d}"

    def slowest(self, seconds: float) -> float:
        """The slowest rank's figure (a step is as slow as its slowest rank)."""
        return max(gather(seconds))

    def span(self, started: float, ended: float) -> float:
        """From the moment the last rank started to the moment the last rank ended."""
        both = gather((started, ended))
        return max(e for _, e in both) - max(s for s, _ in both)

    def sample(self, name: str, seconds: float, nbytes: int) -> None:
        """Add one timing to a figure (as ``Bench.sample``)."""
        self.samples.setdefault(name, {"seconds": [], "nbytes": nbytes})["seconds"].append(seconds)

    def pair(self, name: str, ratio: float) -> None:
        """Add one ratio measured within a round (as ``Bench.pair``)."""
        self.pairs.setdefault(name, []).append(ratio)

    def say(self, line: str) -> None:
        """Progress for people, printed by rank 0."""
        if self.rank == 0:
            print(f"  [mirror] {line}", flush=True)


def gather(value: Any) -> list[Any]:
    """``value`` from every rank, on every rank (default group)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def retire(writer: TieredWriter, keep: str) -> None:
    """Remove this node's copies of every checkpoint but ``keep`` (tmpfs use stays bounded); the
    partner's mirrors of them go by the memory tier's ``keep: 1`` at the next round."""
    root = writer.tier.local_path("")
    assert root is not None
    for child in Path(root).glob("step_*"):
        if child.name != keep:
            shutil.rmtree(child, ignore_errors=True)


def check_mirrored(r: Rank, writer: TieredWriter, checkpoint_id: str) -> RoundTiming:
    """This node's files of ``checkpoint_id`` reached the partner (else the figure means nothing)."""
    timing = r.clock.timings.get(checkpoint_id)
    if timing is None:
        raise RuntimeError(f"rank {r.rank}: no mirror round ran for {checkpoint_id}")
    status = read_status(writer.tier, checkpoint_id, timing.generation, r.rank)
    if status is None or not status.mirrored:
        why = "no status record" if status is None else status.reason
        raise RuntimeError(f"rank {r.rank}: {checkpoint_id} was not mirrored: {why}")
    return timing


def wait_mirrored(r: Rank, writer: TieredWriter, checkpoint_id: str) -> float:
    """Seconds ``wait_mirrored`` took; raises when the exchange outlasts :data:`WAIT_S`."""
    started = time.monotonic()
    if not writer.wait_mirrored(WAIT_S):
        raise RuntimeError(f"rank {r.rank}: mirror of {checkpoint_id} still running after {WAIT_S}s")
    return time.monotonic() - started
