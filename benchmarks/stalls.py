"""Async-save stalls and commits: tierstore (default and overlapped) against torch's default and best.

Each round runs every side back to back on the same state, into the same tmpfs, in an order that
rotates from round to round (no side always goes first, right after the gap):

* **warm copy**: ``copy_`` of every tensor into buffers allocated and touched beforehand, the floor;
* **torch default**: ``dcp.async_save`` with ``FileSystemWriter`` and torch's default stager (a deep
  copy into new memory each save); its stall is ``async_save``'s return;
* **torch best**: torchtitan's recipe, one ``DefaultStager(StagingOptions(use_pinned_memory=<cuda>,
  use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=<cuda>))`` kept for the whole
  run (its buffers are reused), passed as ``async_stager``; timed to ``async_save``'s return, to
  ``staging_completion`` (the stall: when the trainer may modify the state) and to
  ``upload_completion`` (committed);
* **tierstore default**: ``TieredWriter(cfg)``; the stall is ``async_save``'s return (the copy happens
  inside it), committed when its future resolves;
* **tierstore overlapped**: ``TieredWriter(cfg, overlap=True)``; timed like torch best.

Every save is timed from just before ``async_save`` and waited for to the end (committed) before the
next side runs; then ``--gap`` seconds per GiB pass, the training a loop does between saves.

**Under load.** A checkpoint is often taken while the previous one's background work still runs
(persisting, promoting). Every round therefore measures every side a second time while a
:class:`~benchmarks.load.BackgroundLoad` copies a file of the state's size, with a CRC32C, into
another tmpfs directory in a separate process, as a promoter does. The load is started, and known to
be copying, just before each measured operation (the warm copy included, so the ratios compare like
with like) and waited for after it; it is the same for every side. A load of the state's size lasts
longer than any stall, so every stall runs entirely under load; commits that outlast it (torch's
upload) run partly under load, which favours the slower side, so commit ratios under load are only
reported.

Ratios are medians of the per-round ratios, with the targets of the issue "Beat torch's best async
save, not its default".
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from benchmarks.load import BackgroundLoad, make_source
from benchmarks.phase import Bench
from benchmarks.workload import plain_write, remove_plain, state_bytes, warm_copy
from tierstore import TieredWriter
from tierstore.promote.retention import delete_copy
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier

LOADED = " (under load)"
TARGETS = {
    f"{name}{suffix}": target
    for name, target in {
        "stall / warm copy": ("<=", 1.2),
        "overlapped stall / warm copy": ("<=", 1.2),
        "stall / torch best stall": ("<=", 1.0),
        "overlapped stall / torch best stall": ("<=", 1.0),
        "overlapped async_save return / warm copy": ("<=", 0.1),
    }.items()
    for suffix in ("", LOADED)
} | {"stall / torch default stall": ("<=", 0.6)}
"""The stall targets (quiet and under load); the rest of bench.py's targets live there."""


@dataclasses.dataclass(frozen=True)
class SaveTimes:
    """Seconds from just before ``async_save`` to: its return, the state being free, the commit."""

    returned: float
    staged: float
    committed: float


def time_async_save(state: Any, **kwargs: Any) -> SaveTimes:
    """One ``dcp.async_save``, waited for to the end; a plain future counts as staged on return."""
    started = time.perf_counter()
    response = dcp.async_save(state, **kwargs)
    returned = time.perf_counter() - started
    if isinstance(response, AsyncSaveResponse):
        response.staging_completion.result()
        staged = time.perf_counter() - started
        response.upload_completion.result()
    else:
        staged = returned
        response.result()
    return SaveTimes(returned, staged, time.perf_counter() - started)


def best_stager() -> DefaultStager:
    """torch's fastest native staging (torchtitan's recipe); pinned and non-blocking need CUDA."""
    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
        )
    )


class Sides:
    """The sides of one round, each a callable that saves (or copies) once and records its times."""

    def __init__(self, bench: Bench, state: Any) -> None:
        self.bench, self.state = bench, state
        self.config = bench.config("memory", namespace="async")
        self.ram = make_tier(self.config.tiers[0], namespace="async", node=0)
        # one writer per mode and one stager, as in a training loop: their buffers are reused
        self.default = TieredWriter(self.config)
        self.overlapped = TieredWriter(self.config, overlap=True)
        self.stager = best_stager()
        self.copy = warm_copy(state)
        self.count = 0
        self.last_id: str | None = None
        self.times: dict[str, SaveTimes] = {}
        self.timings: dict[str, Any] = {}
        """The marker's own timings of each tierstore side's last save (``commit_s``, ``wait_s``)."""

    def close(self) -> None:
        self.stager.close()
        self.overlapped.close()
        self.default.close()

    def torch_save(self, name: str, **kwargs: Any) -> None:
        directory = self.bench.shm / "torch-async"
        self.times[name] = time_async_save(
            self.state, storage_writer=FileSystemWriter(str(directory)), **kwargs
        )
        shutil.rmtree(directory)

    def tierstore_save(self, name: str, writer: TieredWriter) -> None:
        self.count += 1
        checkpoint_id = f"step_{self.count:06d}"
        self.times[name] = time_async_save(self.state, storage_writer=writer, checkpoint_id=checkpoint_id)
        self.timings[name] = read_manifest(self.ram, checkpoint_id, trust=MarkerTrust()).timings
        if self.last_id is not None:
            delete_copy(self.ram, self.last_id, trust=MarkerTrust())  # keep tmpfs use bounded
        self.last_id = checkpoint_id

    def warm(self) -> None:
        started = time.perf_counter()
        self.copy()
        self.times["warm copy"] = SaveTimes(0.0, time.perf_counter() - started, 0.0)

    def all(self, loaded: bool) -> list[Callable[[], None]]:
        """The sides measured in one condition (torch's default only when quiet: it is slow)."""
        sides: list[Callable[[], None]] = [
            self.warm,
            lambda: self.torch_save("torch best", async_stager=self.stager),
            lambda: self.tierstore_save("tierstore default", self.default),
            lambda: self.tierstore_save("tierstore overlapped", self.overlapped),
        ]
        if not loaded:
            sides.append(lambda: self.torch_save("torch default"))
        return sides


def phase_stalls(bench: Bench, state: Any) -> None:
    """Rounds of every side, quiet then under load; see the module docstring."""
    nbytes = state_bytes(state)
    gap = bench.args.gap * max(1.0, nbytes / 2**30)
    print(
        "async saves (rounds of: warm copy, torch best, tierstore default, tierstore overlapped,"
        f" torch default, plain tmpfs write; then all but the last two under load; {gap:.1f} s apart)",
        flush=True,
    )
    source = bench.shm / "load-source.bin"
    make_source(source, nbytes)
    plain = plain_write(state, str(bench.shm), fsync=False)
    sides = Sides(bench, state)
    try:
        with BackgroundLoad(source, bench.shm / "load") as load:
            for index in range(bench.args.reps + 1):  # round 0 allocates everything: not counted
                for loaded in (False, True):
                    run_round(sides, load if loaded else None, index, gap)
                    if index:
                        record_round(bench, sides, nbytes, LOADED if loaded else "")
                    if not loaded:  # the plain write below runs quiet: so does this commit
                        commit = float(sides.timings["tierstore default"]["commit_s"])
                if index:
                    write = _timed(plain, remove_plain(str(bench.shm)))
                    bench.sample("plain write, tmpfs", write, nbytes)
                    bench.pair("memory commit / plain tmpfs write (bandwidth)", write / commit)
    finally:
        sides.close()
        source.unlink()
        # plain.bin stays: the reads phase reads it back (and removes it); cleanup removes it too.
    bench.show(*[name for name in bench.results if _is_stall_figure(name)])
    bench.extra["memory checkpoint"] = sides.last_id


def run_round(sides: Sides, load: BackgroundLoad | None, index: int, gap: float) -> None:
    """Every side once, in an order rotated by ``index``, each under ``load`` if given."""
    order = sides.all(loaded=load is not None)
    shift = index % len(order)
    for side in order[shift:] + order[:shift]:
        if load is not None:
            load.start()
        side()
        if load is not None:
            load.wait()
        time.sleep(gap)


def record_round(bench: Bench, sides: Sides, nbytes: int, suffix: str) -> None:
    """The figures and per-round ratios of one condition of one round."""
    times, timings = sides.times, sides.timings
    warm = times["warm copy"].staged
    best, default = times["torch best"], times["tierstore default"]
    overlapped = times["tierstore overlapped"]
    figures = {
        "warm copy (reused buffers)": warm,
        "torch best: async_save return": best.returned,
        "torch best: staging_completion (stall)": best.staged,
        "torch best: upload_completion (committed)": best.committed,
        "tierstore default: async_save return (stall)": default.staged,
        "tierstore default: committed": default.committed,
        "tierstore default: commit in memory tier (marker)": float(timings["tierstore default"]["commit_s"]),
        "tierstore overlapped: async_save return": overlapped.returned,
        "tierstore overlapped: staging_completion (stall)": overlapped.staged,
        "tierstore overlapped: upload_completion (committed)": overlapped.committed,
    }
    if not suffix:
        figures["torch default: async_save return (stall)"] = times["torch default"].staged
    for name, seconds in figures.items():
        bench.sample(f"{name}{suffix}", seconds, nbytes)
    ratios = {
        "stall / warm copy": default.staged / warm,
        "overlapped stall / warm copy": overlapped.staged / warm,
        "stall / torch best stall": default.staged / best.staged,
        "overlapped stall / torch best stall": overlapped.staged / best.staged,
        "overlapped async_save return / warm copy": overlapped.returned / warm,
        "torch best async_save return / warm copy": best.returned / warm,
        "torch best stall / warm copy": best.staged / warm,
        "commit / torch best commit": default.committed / best.committed,
        "overlapped commit / torch best commit": overlapped.committed / best.committed,
    }
    if not suffix:
        ratios["stall / torch default stall"] = default.staged / times["torch default"].staged
    for name, ratio in ratios.items():
        bench.pair(f"{name}{suffix}", ratio)
    for name in ("tierstore default", "tierstore overlapped"):
        waits = bench.extra.setdefault(f"{name} wait_s{suffix}", [])
        waits.append(timings[name]["wait_s"])  # time spent waiting for a free buffer


def _is_stall_figure(name: str) -> bool:
    return name.startswith(("warm copy", "torch ", "tierstore ", "plain write, tmpfs"))


def _timed(run: Callable[[], None], setup: Callable[[], None]) -> float:
    """As ``bench.timed``: setup and a sync untimed (bench.py imports this module, not the reverse)."""
    setup()
    os.sync()
    started = time.perf_counter()
    run()
    return time.perf_counter() - started
