"""tierstore benchmark: every figure side by side in one run, reported as ratios.

    python benchmarks/bench.py [--size 1GiB] [--reps 5] [--s3-reps 3] [--out bench-results]

Measures, on a synthetic transformer-shaped training state (parameters and AdamW moments, fp32):

* limits: a copy into warm buffers; a plain write to tmpfs and to disk (with fsync); a plain read back;
* async saves (:mod:`benchmarks.stalls`), quiet and under a background load: torch's default stager
  and torch's best (``DefaultStager`` with async staging, reused buffers) against tierstore's default
  and overlapped modes: the time ``async_save`` takes to return, the stall (until the state may be
  modified) and the time to commit;
* torch: ``FileSystemWriter`` save, the stall of the first save of a fresh process,
  ``FileSystemReader`` load, ``FsspecWriter``/``FsspecReader`` against an S3 server;
* tierstore: the stall of the first save of a fresh process, a save to a local tier, restores from
  memory, local and S3 tiers, a promotion to S3 next to boto3 uploading the same bytes to the same
  server, the restore from S3 next to boto3 downloading them, ``latest_committed`` and ``ls`` over
  1,000 checkpoints in four tiers;
* peer mirror (:mod:`benchmarks.mirror`): two ranks on two simulated nodes, the mirror exchange
  against plain gloo send/recv, the stall with and without mirroring, a lost node's restore from its
  partner's memory against a shared disk tier and S3;
* a scale sweep (256 MiB to 2 GiB).

S3 is moto's server on 127.0.0.1, started here; it, not the client, limits S3 throughput, so S3
figures are only comparable with each other. Between consecutive async saves the benchmark waits for
the save to finish and then ``--gap`` seconds, the training a real loop does between saves. Disk reads
come from the page cache (the file was just written), for the baseline and for tierstore alike.
Writes a table to stdout, ``bench.json`` and ``sweep.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.mirror import TARGETS as MIRROR_TARGETS
from benchmarks.mirror import phase_mirror
from benchmarks.stalls import TARGETS as STALL_TARGETS
from benchmarks.stalls import phase_stalls
from benchmarks.workload import (
    Samples,
    model_state,
    plain_read,
    plain_write,
    quiet_warnings,
    remove_plain,
    state_bytes,
    tensors_of,
    zeros_like_state,
)
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config, config_from_dict
from tierstore.ids import checkpoint_file
from tierstore.promote.retention import delete_copy
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier
from tierstore.units import parse_size

TARGETS = (
    STALL_TARGETS
    | MIRROR_TARGETS
    | {
        "memory commit / plain tmpfs write (bandwidth)": (">=", 0.7),
        "local save / plain write+fsync (bandwidth)": (">=", 0.9),
        "restore from memory / plain tmpfs read (bandwidth)": (">=", 0.8),
        "restore from memory, s3 configured / memory-only config (time)": ("<=", 1.1),
        "restore from local / plain disk read (bandwidth)": (">=", 0.8),
        "promotion to s3 / best boto3 upload (bandwidth)": (">=", 0.95),
        "restore from s3 / best boto3 download (bandwidth)": (">=", 0.9),
        "latest_committed, 1000 x 4 tiers (seconds)": ("<", 1.0),
        "first-save stall / torch first-save stall": ("<=", 1.0),
    }
)


PHASES = ("stalls", "disk", "reads", "s3", "first", "mirror", "sweep", "goodput", "s3real")
"""The parts of a run, in the order they run (``--phases``)."""


class Bench:
    """One benchmark run: directories, configurations, and every figure measured."""

    def __init__(self, args: argparse.Namespace, endpoint: str) -> None:
        self.args = args
        self.endpoint = endpoint
        self.shm = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir=args.memory_dir))
        self.disk = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir=args.disk_dir))
        self.results: dict[str, Samples] = {}
        self.pairs: dict[str, list[float]] = {}
        self.extra: dict[str, Any] = {}
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=endpoint)
        self.bucket = "bench"
        self.s3.create_bucket(Bucket=self.bucket)

    def config(self, *kinds: str, namespace: str) -> Config:
        tiers: list[dict[str, Any]] = []
        for kind in kinds:
            if kind == "memory":
                tiers.append({"name": "ram", "type": "memory", "path": str(self.shm / "ram")})
            elif kind == "local":
                tiers.append({"name": "nvme", "type": "local", "path": str(self.disk / "nvme")})
            elif kind == "shared":
                tiers.append({"name": "pfs", "type": "shared", "path": str(self.disk / "pfs")})
            else:
                tiers.append(
                    {
                        "name": "s3",
                        "type": "s3",
                        "url": f"s3://{self.bucket}/tierstore",
                        "endpoint_url": self.endpoint,
                    }
                )
        return config_from_dict({"namespace": namespace, "tiers": tiers})

    def sample(self, name: str, seconds: float, nbytes: int) -> None:
        """Add one timing to a figure."""
        self.results.setdefault(name, Samples(nbytes=nbytes)).seconds.append(seconds)

    def pair(self, name: str, ratio: float) -> None:
        """Add one ratio measured within a round (both sides back to back)."""
        self.pairs.setdefault(name, []).append(ratio)

    def record(self, name: str, samples: Samples) -> None:
        """Keep a whole set of samples and print it."""
        self.results[name] = samples
        self.show(name)

    def show(self, *names: str) -> None:
        for name in names:
            samples = self.results[name]
            print(f"  {name:<68} {samples.median:8.3f} s  {samples.gib_s:7.2f} GiB/s", flush=True)

    def release(self) -> None:
        """Drop every checkpoint, file and S3 object made so far: the later phases (fresh
        processes first of all) must not start on a machine short of free memory. With 12 GiB
        in tmpfs, a first save's copy into fresh pages took 0.3-1.0 s on either side, not 0.3."""
        for directory in (self.shm, self.disk):
            for entry in directory.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def cleanup(self) -> None:
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)


def timed(run: Any, setup: Any = None) -> float:
    """Seconds ``run()`` takes; ``setup()`` and a sync first, untimed (see ``workload.repeat``)."""
    if setup is not None:
        setup()
    os.sync()
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def in_turns(index: int, runs: list[Any]) -> list[float]:
    """Run ``runs`` starting at the one ``index`` rotates to; their results in the given order."""
    shift = index % len(runs)
    results = [0.0] * len(runs)
    for position in [*range(shift, len(runs)), *range(shift)]:
        results[position] = runs[position]()
    return results


def async_stall(state: Any, writer: Any, checkpoint_id: str | None) -> float:
    """The trainer's stall of one ``async_save`` (then wait for the save to finish)."""
    started = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
    stall = time.perf_counter() - started
    future.result()
    return stall


def phase_disk(bench: Bench, state: Any) -> None:
    """Rounds of: plain write+fsync, tierstore save to a local tier, torch FileSystemWriter."""
    from torch.distributed.checkpoint import FileSystemWriter

    nbytes = state_bytes(state)
    print("disk (rounds of: plain write+fsync, tierstore local tier, torch FileSystemWriter)")
    local = bench.config("local", namespace="local")
    nvme = make_tier(local.tiers[0], namespace=local.namespace, node=0)
    plain = plain_write(state, str(bench.disk), fsync=True)
    torch_dir = bench.disk / "torch-fs"
    for _ in range(bench.args.reps):
        write = timed(plain, remove_plain(str(bench.disk)))
        ours = timed(
            lambda: dcp.save(state, storage_writer=TieredWriter(local), checkpoint_id="step_000000"),
            lambda: delete_copy(nvme, "step_000000", trust=MarkerTrust()),
        )
        theirs = timed(
            lambda: dcp.save(state, storage_writer=FileSystemWriter(str(torch_dir))),
            lambda: shutil.rmtree(torch_dir, ignore_errors=True),
        )
        bench.sample("plain write+fsync, disk", write, nbytes)
        bench.sample("tierstore save to local tier (sync)", ours, nbytes)
        bench.sample("torch FileSystemWriter save, disk", theirs, nbytes)
        bench.pair("local save / plain write+fsync (bandwidth)", write / ours)
        bench.pair("local save / torch FileSystemWriter (bandwidth)", theirs / ours)
    bench.show(
        "plain write+fsync, disk", "tierstore save to local tier (sync)", "torch FileSystemWriter save, disk"
    )


def phase_reads(bench: Bench, state: Any) -> None:
    """Rounds of: plain reads and restores of the files the previous phases left."""
    from torch.distributed.checkpoint import FileSystemReader

    nbytes = state_bytes(state)
    print("restores (rounds of: plain read, tierstore restore; tmpfs then disk; torch FileSystemReader)")
    restored = zeros_like_state(state)
    memory, local = (bench.config("memory", namespace="async"), bench.config("local", namespace="local"))
    # The same memory copy with a healthy S3 tier below it, as deployed: the promoter's pass (run
    # before each round, untimed) keeps its sightings fresh. What a restore served by host memory
    # pays for a slower tier it does not read (without any sighting: one marker GET).
    beside_s3 = bench.config("memory", "s3", namespace="async")
    memory_id = bench.extra["memory checkpoint"]

    def restore(config: Config, checkpoint_id: str) -> Any:
        return lambda: dcp.load(restored, storage_reader=TieredReader(config), checkpoint_id=checkpoint_id)

    read_tmpfs, read_disk = plain_read(state, str(bench.shm)), plain_read(state, str(bench.disk))
    read_tmpfs()  # warm-up: every reader's destination memory is touched before it is timed
    restore(memory, memory_id)()
    for _ in range(bench.args.reps):
        plain_tmpfs = timed(read_tmpfs)
        from_memory = timed(restore(memory, memory_id))
        Promoter(beside_s3).run(once=True)
        with_s3 = timed(restore(beside_s3, memory_id))
        plain_disk = timed(read_disk)
        from_local = timed(restore(local, "step_000000"))
        theirs = timed(
            lambda: dcp.load(restored, storage_reader=FileSystemReader(str(bench.disk / "torch-fs")))
        )
        measured = {
            "plain read, tmpfs": plain_tmpfs,
            "tierstore restore from memory": from_memory,
            "tierstore restore from memory, s3 configured": with_s3,
            "plain read, disk (page cache)": plain_disk,
            "tierstore restore from local": from_local,
            "torch FileSystemReader load, disk": theirs,
        }
        for name, seconds in measured.items():
            bench.sample(name, seconds, nbytes)
        bench.pair("restore from memory / plain tmpfs read (bandwidth)", plain_tmpfs / from_memory)
        bench.pair("restore from memory, s3 configured / memory-only config (time)", with_s3 / from_memory)
        bench.pair("restore from local / plain disk read (bandwidth)", plain_disk / from_local)
        bench.pair("restore from local / torch FileSystemReader (bandwidth)", theirs / from_local)
    bench.show(
        "plain read, tmpfs",
        "tierstore restore from memory",
        "tierstore restore from memory, s3 configured",
        "plain read, disk (page cache)",
        "tierstore restore from local",
        "torch FileSystemReader load, disk",
    )
    os.unlink(bench.shm / "plain.bin")


def phase_s3(bench: Bench) -> None:
    """Rounds of: promotion to S3, boto3 uploading the same bytes, restores; torch's fsspec I/O."""
    from boto3.s3.transfer import TransferConfig
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    # moto is the second S3 column (s3_real.py measures the real server): a state of its own,
    # --moto-size, keeps its rounds short (at 1 GiB they took 4.4 of make bench's 27 minutes)
    state = model_state(parse_size(bench.args.moto_size), seed=1)
    nbytes = state_bytes(state)
    print(
        f"s3 on moto, {nbytes / 2**20:.0f} MiB (rounds of: tierstore promotion and boto3"
        " upload_file in turns, restore and download_file in turns; torch fsspec)"
    )
    namespace, checkpoint_id = "moto", "step_000001"
    memory_config = bench.config("memory", namespace=namespace)
    dcp.save(state, storage_writer=TieredWriter(memory_config), checkpoint_id=checkpoint_id)
    ram = make_tier(memory_config.tiers[0], namespace=namespace, node=0)
    files = read_manifest(ram, checkpoint_id, trust=MarkerTrust()).files
    data_bytes = sum(f.size for f in files)
    biggest = max(files, key=lambda f: f.size)
    source = ram.local_path(checkpoint_file(checkpoint_id, biggest.path))
    # moto serialises requests: more in flight only slows boto3 down (in the 2026-12-03 run, 10
    # took 1.15x the time of 4 to upload and 1.22x to download), so the trial stops at 8
    configs = {c: TransferConfig(multipart_chunksize=64 * 2**20, max_concurrency=c) for c in (4, 8)}
    trial = {
        c: timed(lambda c=c: bench.s3.upload_file(source, bench.bucket, "boto3/try", Config=configs[c]))
        for c in configs
    }
    best = min(trial, key=lambda c: trial[c])
    bench.extra["boto3 upload_file trial (concurrency: seconds)"] = trial
    landing = bench.shm / "boto3-download.bin"  # into memory, as a restore lands in tensors

    def download(concurrency: int) -> None:
        bench.s3.download_file(bench.bucket, "boto3/try", str(landing), Config=configs[concurrency])

    fetch_trial = {
        c: timed(lambda c=c: download(c), lambda: landing.unlink(missing_ok=True)) for c in configs
    }
    fetch_best = min(fetch_trial, key=lambda c: fetch_trial[c])
    bench.extra["boto3 download_file trial (concurrency: seconds)"] = fetch_trial
    restored = zeros_like_state(state)
    os.environ["AWS_ENDPOINT_URL_S3"] = bench.endpoint  # FsspecWriter.reset drops storage options
    # tierstore's S3 tier gets the requests in flight boto3 found best on this server, for uploads
    # and for downloads: the same tuning for both sides (moto slows down with more in flight).
    memory = memory_config.tiers[0].model_dump()
    s3_tier = bench.config("s3", namespace="x").tiers[0].model_dump()
    both = config_from_dict({"namespace": namespace, "tiers": [memory, {**s3_tier, "concurrency": best}]})
    s3_only = config_from_dict({"namespace": namespace, "tiers": [{**s3_tier, "concurrency": fetch_best}]})
    s3 = make_tier(both.tiers[1], namespace=namespace, node=0)
    promoter = Promoter(both)  # one for every round, as the sidecar is: its clients are made once
    promotions: list[float] = []

    def promote() -> None:
        before = promoter.metrics.promotion_seconds.labels("s3")._sum.get()
        report = promoter.run_once()
        assert report.promoted and not report.failed, report
        # the promotion itself (copy, verify, marker), as the promoter's metric reports it
        promotions.append(promoter.metrics.promotion_seconds.labels("s3")._sum.get() - before)

    # boto3's side was warmed by its trials; the promoter (its clients, the server's handling of
    # its requests) gets one untimed promotion too. Cold, the first round's promotion took 13 s
    # against 9.5-10.5 s in the later rounds.
    timed(promote, lambda: delete_copy(s3, checkpoint_id, trust=MarkerTrust()))
    promotions.clear()
    for index in range(bench.args.s3_reps):  # each pair in turns: neither side always goes first
        whole_pass, theirs = in_turns(
            index,
            [
                lambda: timed(promote, lambda: delete_copy(s3, checkpoint_id, trust=MarkerTrust())),
                lambda: timed(
                    lambda: bench.s3.upload_file(
                        source, bench.bucket, "boto3/upload.bin", Config=configs[best]
                    )
                ),
            ],
        )
        ours = promotions[-1]
        back, fetched = in_turns(
            index,
            [
                lambda: timed(
                    lambda: dcp.load(
                        restored, storage_reader=TieredReader(s3_only), checkpoint_id=checkpoint_id
                    )
                ),
                lambda: timed(lambda: download(fetch_best), lambda: landing.unlink(missing_ok=True)),
            ],
        )
        bench.sample("tierstore promotion memory -> s3", ours, data_bytes)
        bench.sample("tierstore promoter pass (discovery, promotion, retention, gc)", whole_pass, data_bytes)
        bench.sample(f"boto3 upload_file, same bytes (concurrency {best})", theirs, biggest.size)
        bench.sample("tierstore restore from s3", back, nbytes)
        bench.sample(f"boto3 download_file, same bytes (concurrency {fetch_best})", fetched, biggest.size)
        bench.pair(
            "promotion to s3 / best boto3 upload (bandwidth)", (theirs / biggest.size) / (ours / data_bytes)
        )
        bench.pair(
            "restore from s3 / best boto3 download (bandwidth)", (fetched / biggest.size) / (back / nbytes)
        )
        if index > 0:
            # torch's fsspec I/O is a second column only, 4-6x slower than the rest on moto (50 s a
            # round at 1 GiB): one round of it, beside the first round's restore.
            continue
        fs_save = timed(
            lambda: dcp.save(state, storage_writer=FsspecWriter(f"s3://{bench.bucket}/torch-fsspec"))
        )
        fs_load = timed(
            lambda: dcp.load(restored, storage_reader=FsspecReader(f"s3://{bench.bucket}/torch-fsspec"))
        )
        bench.sample("torch FsspecWriter save, s3", fs_save, nbytes)
        bench.sample("torch FsspecReader load, s3", fs_load, nbytes)
        bench.pair("restore from s3 / torch FsspecReader (bandwidth)", fs_load / back)
    bench.show(
        "tierstore promotion memory -> s3",
        "tierstore promoter pass (discovery, promotion, retention, gc)",
        f"boto3 upload_file, same bytes (concurrency {best})",
        "tierstore restore from s3",
        f"boto3 download_file, same bytes (concurrency {fetch_best})",
        "torch FsspecWriter save, s3",
        "torch FsspecReader load, s3",
    )
    landing.unlink(missing_ok=True)


def phase_first_saves(bench: Bench) -> None:
    """Fresh processes, one per kind in each round, in an order rotated from round to round."""
    print("first save in a fresh process", flush=True)
    kinds = ("torch", "tierstore", "tierstore-prepared")
    samples = {kind: Samples(nbytes=parse_size(bench.args.size)) for kind in kinds}
    for index in range(max(1, bench.args.first_reps)):
        shift = index % len(kinds)  # no kind always runs right after another's exit
        for kind in kinds[shift:] + kinds[:shift]:
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--first-save",
                    kind,
                    "--size",
                    bench.args.size,
                    "--disk-dir",
                    str(bench.shm),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            samples[kind].seconds.append(json.loads(done.stdout.strip().splitlines()[-1])["stall_s"])
        bench.pair(
            "first-save stall / torch first-save stall",
            samples["tierstore"].seconds[-1] / samples["torch"].seconds[-1],
        )
    for kind in kinds:
        bench.record(f"{kind} async_save stall, first save of a fresh process", samples[kind])


def first_save(kind: str, size: str, directory: str) -> None:
    """Child process: build the state, time one async_save's stall, print it as JSON."""
    from torch.distributed.checkpoint import FileSystemWriter

    state = model_state(parse_size(size))
    root = tempfile.mkdtemp(dir=directory)
    config = config_from_dict({"tiers": [{"name": "ram", "type": "memory", "path": root}]})
    writer = FileSystemWriter(f"{root}/torch") if kind == "torch" else TieredWriter(config)
    if kind == "tierstore-prepared":  # the buffers were allocated at start-up, in the background
        assert isinstance(writer, TieredWriter)
        writer.prepare(state)
        writer._stager_for_this_process().wait_until_prepared()
    with quiet_warnings():
        started = time.perf_counter()
        future = dcp.async_save(
            state, storage_writer=writer, checkpoint_id=None if kind == "torch" else "first"
        )
        stall = time.perf_counter() - started
        future.result()
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"stall_s": stall}))


def phase_sweep(bench: Bench) -> list[dict[str, Any]]:
    """Stall, memory-tier commit and local save at several sizes: linear in bytes, same file count."""
    print("scale sweep", flush=True)
    rows = []
    for size in bench.args.sweep:
        state = model_state(parse_size(size))
        nbytes = state_bytes(state)
        gap = bench.args.gap * max(1.0, nbytes / 2**30)
        memory = bench.config("memory", namespace=f"sweep-{size}")
        ram = make_tier(memory.tiers[0], namespace=memory.namespace, node=0)
        writer = TieredWriter(memory)
        stalls, commits, waits = [], [], []
        for index in range(3):  # the first save allocates: the figures are the last two
            stalls.append(async_stall(state, writer, f"step_{index:06d}"))
            timings = read_manifest(ram, f"step_{index:06d}", trust=MarkerTrust()).timings
            commits.append(float(timings["commit_s"] or 0))
            waits.append(float(timings["wait_s"] or 0))
            if index:
                delete_copy(ram, f"step_{index - 1:06d}", trust=MarkerTrust())
            time.sleep(gap)
        files = sum(1 for f in read_manifest(ram, "step_000002", trust=MarkerTrust()).files if f.rank == 0)
        writer.close()
        local = bench.config("local", namespace=f"sweep-{size}")

        def save_local(state: Any = state, local: Config = local) -> None:
            dcp.save(state, storage_writer=TieredWriter(local), checkpoint_id="step_0")

        nvme = make_tier(local.tiers[0], namespace=local.namespace, node=0)
        local_s = statistics.median(
            timed(save_local, lambda n=nvme: delete_copy(n, "step_0", trust=MarkerTrust())) for _ in range(3)
        )
        rows.append(
            {
                "size": size,
                "bytes": nbytes,
                "tensors": len(list(tensors_of(state))),
                "stall_s": statistics.median(stalls[1:]),
                "commit_s": statistics.median(commits[1:]),
                "wait_s": statistics.median(waits[1:]),
                "local_save_s": local_s,
                "files_per_rank": files,
            }
        )
        row = rows[-1]
        print(
            f"  {size:>7}: stall {row['stall_s']:.3f} s, commit {row['commit_s']:.3f} s,"
            f" local save {local_s:.3f} s, {files} files per rank",
            flush=True,
        )
        shutil.rmtree(bench.shm / "ram", ignore_errors=True)
        shutil.rmtree(bench.disk / "nvme", ignore_errors=True)
        del state
    return rows


def ratios(bench: Bench) -> dict[str, dict[str, Any]]:
    """Each ratio: the median of the ratios measured within rounds (both sides back to back)."""
    values = {name: statistics.median(found) for name, found in bench.pairs.items()}
    if "latest_committed, 1000 checkpoints x 4 tiers" in bench.results:
        values["latest_committed, 1000 x 4 tiers (seconds)"] = bench.results[
            "latest_committed, 1000 checkpoints x 4 tiers"
        ].median
    out = {}
    for name, value in values.items():
        if name in TARGETS:
            op, target = TARGETS[name]
            met = value <= target if op == "<=" else value >= target if op == ">=" else value < target
            out[name] = {
                "value": value,
                "target": f"{op} {target}",
                "met": met,
                "rounds": bench.pairs.get(name),
            }
        else:
            out[name] = {"value": value, "target": "(reported)", "met": None, "rounds": bench.pairs.get(name)}
    return out


PHASE_SECONDS: dict[str, float] = {}
"""Wall seconds each phase took in this run (printed, and kept in bench.json): what ``make bench``'s
time is made of."""


def clocked(name: str, run: Any, *args: Any) -> Any:
    """``run(*args)``, its wall time kept in :data:`PHASE_SECONDS` and printed."""
    started = time.perf_counter()
    try:
        return run(*args)
    finally:
        PHASE_SECONDS[name] = round(time.perf_counter() - started, 1)
        print(f"[{name}: {PHASE_SECONDS[name]:.0f} s]", flush=True)


def run_with_state(bench: Bench, phases: set[str]) -> None:
    """The phases that share one state of ``--size`` (built here, freed after them)."""
    args = bench.args
    state = model_state(parse_size(args.size))
    count = len(list(tensors_of(state)))
    print(
        f"state: {state_bytes(state) / 2**30:.2f} GiB in {count} tensors; {os.cpu_count()} cores;"
        f" median of {args.reps} (S3: {args.s3_reps})",
        flush=True,
    )
    if "stalls" in phases:
        clocked("stalls", phase_stalls, bench, state)
    if "disk" in phases:
        clocked("disk", phase_disk, bench, state)
    if "reads" in phases:
        clocked("reads", phase_reads, bench, state)
    bench.release()


def run_goodput(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run ``goodput.py`` in a fresh process; its figures, as it wrote them to ``out``."""
    print("training-loop goodput (benchmarks/goodput.py)", flush=True)
    script = Path(__file__).resolve().parent / "goodput.py"
    # torch's checkpoint process (PROCESS mode) logs every request at INFO on stderr: keep it aside
    with open(out / "goodput.log", "w") as log:
        subprocess.run(
            [
                sys.executable,
                str(script),
                "--size",
                args.goodput_size,
                "--reps",
                str(args.goodput_reps),
                "--out",
                str(out),
            ],
            check=True,
            stderr=log,
        )
    found: dict[str, Any] = json.loads((out / "goodput.json").read_text())
    return found


def run_s3_real(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run ``s3_real.py`` (S3 on a real server) in a fresh process; its figures, as it wrote them."""
    script = Path(__file__).resolve().parent / "s3_real.py"
    subprocess.run([sys.executable, str(script), "--size", args.s3_real_size, "--out", str(out)], check=True)
    found: dict[str, Any] = json.loads((out / "s3_real.json").read_text())
    return found


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = [row["bytes"] / 2**30 for row in rows]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("stall_s", "async stall"),
        ("commit_s", "commit in memory tier"),
        ("local_save_s", "save to local tier (sync)"),
    ):
        axis.plot(gib, [row[key] for row in rows], marker="o", label=label)
    for x, row in zip(gib, rows, strict=True):
        axis.annotate(
            f"{row['files_per_rank']} files/rank",
            (x, row["local_save_s"]),
            textcoords="offset points",
            xytext=(0, 6),
            fontsize=7,
            ha="center",
        )
    axis.set_xlabel("state size (GiB)")
    axis.set_ylabel("seconds (median)")
    axis.set_title("tierstore scale sweep (this machine)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--s3-reps", type=int, default=3)
    parser.add_argument("--first-reps", type=int, default=5, help="rounds of first saves (fresh processes)")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds of 'training' between saves")
    parser.add_argument("--sweep", nargs="*", default=["256MiB", "512MiB", "1GiB", "2GiB"])
    parser.add_argument("--disk-dir", default=tempfile.gettempdir())
    parser.add_argument(
        "--memory-dir",
        default="/dev/shm",
        help="the tmpfs the memory tiers live in (e.g. one mounted with huge=within_size)",
    )
    parser.add_argument("--out", default="bench-results")
    parser.add_argument(
        "--first-save", choices=["torch", "tierstore", "tierstore-prepared"], help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--phases",
        nargs="*",
        choices=PHASES,
        default=list(PHASES),
        help="what to measure (default: everything; reads restores what stalls and disk saved)",
    )
    parser.add_argument(
        "--goodput-size", default="256MiB", help="goodput.py's --size (smaller than alone: time)"
    )
    parser.add_argument("--goodput-reps", type=int, default=3, help="goodput.py's --reps")
    parser.add_argument("--s3-real-size", default="512MiB", help="s3_real.py's --size")
    parser.add_argument(
        "--moto-size", default="512MiB", help="state of the S3 phase on moto (the second column)"
    )
    parser.add_argument(
        "--mirror-size", default="256MiB", help="state per rank of the peer-mirror phase (2 ranks)"
    )
    args = parser.parse_args()
    chosen = set(args.phases)
    if "reads" in chosen and not {"stalls", "disk"} <= chosen:
        parser.error("--phases: reads needs stalls and disk")
    if args.first_save:
        first_save(args.first_save, args.size, args.disk_dir)
        return
    import logging

    from tierstore.testing import embedded_s3

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the embedded S3 server's access log
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    with embedded_s3(own_process=True) as endpoint, quiet_warnings():
        bench = Bench(args, endpoint)
        try:
            phases = set(args.phases)
            if phases & {"stalls", "disk", "reads"}:
                run_with_state(bench, phases)
            if "s3" in phases:
                clocked("s3", phase_s3, bench)
                bench.release()
            if "first" in phases:
                clocked("first", phase_first_saves, bench)
            if "mirror" in phases:
                clocked("mirror", phase_mirror, bench)
            rows = clocked("sweep", phase_sweep, bench) if args.sweep and "sweep" in phases else []
        finally:
            bench.cleanup()
    # in a process of its own: it starts a process group, and its model's threads must not linger here
    goodput = clocked("goodput", run_goodput, args, out) if "goodput" in phases else None
    s3_real = clocked("s3real", run_s3_real, args, out) if "s3real" in phases else None
    table = ratios(bench)
    print("\nratios (one run, this machine)")
    for name, row in table.items():
        verdict = {True: "met", False: "MISSED", None: ""}[row["met"]]
        print(f"  {name:<68} {row['value']:8.3f}  {row['target']:>10}  {verdict}")
    report = {
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "arguments": vars(args),
        "phase_seconds": PHASE_SECONDS,
        "results": {name: s.as_dict() for name, s in bench.results.items()},
        "extra": bench.extra,
        "ratios": table,
        "sweep": rows,
        "goodput": goodput,
        "s3_real": s3_real,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    if rows:
        plot(rows, out / "sweep.png")
    print(f"\nwrote {out / 'bench.json'}" + (f" and {out / 'sweep.png'}" if rows else ""))


if __name__ == "__main__":
    main()
