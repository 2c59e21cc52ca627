"""tierstore benchmark: every figure side by side in one run, reported as ratios.

    python benchmarks/bench.py [--size 1GiB] [--reps 5] [--s3-reps 3] [--out bench-results]

Measures, on a synthetic transformer-shaped training state (parameters and AdamW moments, fp32):

* limits: a copy into warm buffers; a plain write to tmpfs and to disk (with fsync); a plain read back;
* torch: ``FileSystemWriter`` save, ``async_save`` stall with torch's default stager (steady state, and
  the first save of a fresh process), ``FileSystemReader`` load, ``FsspecWriter``/``FsspecReader``
  against an S3 server;
* tierstore: the async stall (steady, and first save of a fresh process), the time to commit in the
  memory tier, a save to a local tier, restores from memory, local and S3 tiers, a promotion to S3
  next to boto3 uploading the same bytes to the same server, ``latest_committed`` and ``ls`` over
  1,000 checkpoints in four tiers;
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.workload import (
    Samples,
    model_state,
    plain_read,
    plain_write,
    quiet_warnings,
    remove_plain,
    repeat,
    state_bytes,
    tensors_of,
    warm_copy,
    zeros_like_state,
)
from tierstore import Catalog, TieredReader, TieredWriter, latest_committed
from tierstore.config import Config, config_from_dict, parse_size
from tierstore.manifest import read_manifest
from tierstore.promoter import Promoter
from tierstore.promotion import delete_copy
from tierstore.tiers import make_tier

TARGETS = {
    "stall / warm copy": ("<=", 1.5),
    "stall / torch default stall": ("<=", 0.6),
    "memory commit / plain tmpfs write (bandwidth)": (">=", 0.7),
    "local save / plain write+fsync (bandwidth)": (">=", 0.9),
    "restore from memory / plain tmpfs read (bandwidth)": (">=", 0.8),
    "restore from local / plain disk read (bandwidth)": (">=", 0.8),
    "promotion to s3 / best boto3 upload (bandwidth)": (">=", 0.9),
    "latest_committed, 1000 x 4 tiers (seconds)": ("<", 1.0),
}


class Bench:
    """One benchmark run: directories, configuration, results."""

    def __init__(self, args: argparse.Namespace, endpoint: str) -> None:
        self.args = args
        self.endpoint = endpoint
        self.shm = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir="/dev/shm"))
        self.disk = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir=args.disk_dir))
        self.results: dict[str, Samples] = {}
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
                tiers.append({"name": "s3", "type": "s3", "url": f"s3://{self.bucket}/tierstore",
                              "endpoint_url": self.endpoint})  # fmt: skip
        return config_from_dict({"namespace": namespace, "tiers": tiers})

    def record(self, name: str, samples: Samples) -> Samples:
        self.results[name] = samples
        print(f"  {name:<52} {samples.median:8.3f} s  {samples.gib_s:7.2f} GiB/s", flush=True)
        return samples

    def cleanup(self) -> None:
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)


def async_stalls(
    state: Any, writer_for: Any, reps: int, gap: float, after_each: Any = None
) -> Samples:
    """Consecutive async saves: the stall of each (first one included), waiting in between.

    ``writer_for(index)`` gives the storage writer of save ``index``; ``after_each(index)`` runs once
    that save has finished, before the ``gap`` of simulated training.
    """
    stalls = Samples(nbytes=state_bytes(state))
    for index in range(reps):
        writer = writer_for(index)
        started = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=f"step_{index:06d}")
        stalls.seconds.append(time.perf_counter() - started)
        future.result()
        if after_each is not None:
            after_each(index)
        time.sleep(gap)
    return stalls


def steady(samples: Samples) -> Samples:
    """Drop the first save (it allocates): the steady-state samples."""
    return Samples(samples.seconds[1:], samples.nbytes)


def phase_limits(bench: Bench, state: Any) -> None:
    reps, nbytes = bench.args.reps, state_bytes(state)
    print("limits", flush=True)
    bench.record("warm copy (reused buffers)", repeat(reps, nbytes, warm_copy(state)))
    for name, directory, fsync in (("tmpfs", bench.shm, False), ("disk", bench.disk, True)):
        write = plain_write(state, str(directory), fsync=fsync)
        label = "plain write+fsync, disk" if fsync else "plain write, tmpfs"
        bench.record(label, repeat(reps, nbytes, write, setup=remove_plain(str(directory))))
        read_label = "plain read, disk (page cache)" if fsync else "plain read, tmpfs"
        bench.record(read_label, repeat(reps, nbytes, plain_read(state, str(directory))))
        del name
    os.unlink(bench.shm / "plain.bin")


def phase_torch(bench: Bench, state: Any) -> None:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    reps, nbytes = bench.args.reps, state_bytes(state)
    print("torch", flush=True)
    target = bench.disk / "torch-fs"

    def fs_save() -> None:
        dcp.save(state, storage_writer=FileSystemWriter(str(target)))

    bench.record(
        "torch FileSystemWriter save, disk",
        repeat(reps, nbytes, fs_save, setup=lambda: shutil.rmtree(target, ignore_errors=True)),
    )
    restored = zeros_like_state(state)

    def fs_load() -> None:
        dcp.load(restored, storage_reader=FileSystemReader(str(target)))

    bench.record("torch FileSystemReader load, disk", repeat(reps, nbytes, fs_load))
    shutil.rmtree(target)

    def torch_writer(index: int) -> Any:
        return FileSystemWriter(str(bench.shm / f"torch-async-{index}"))

    def drop(index: int) -> None:
        shutil.rmtree(bench.shm / f"torch-async-{index}", ignore_errors=True)

    stalls = async_stalls(state, torch_writer, reps + 1, bench.args.gap, drop)
    bench.record("torch async_save stall, default stager (steady)", steady(stalls))
    s3_reps = bench.args.s3_reps
    os.environ["AWS_ENDPOINT_URL_S3"] = bench.endpoint  # FsspecWriter.reset drops storage options

    def fsspec_save() -> None:
        dcp.save(state, storage_writer=FsspecWriter(f"s3://{bench.bucket}/torch-fsspec"))

    bench.record("torch FsspecWriter save, s3", repeat(s3_reps, nbytes, fsspec_save))
    bench.record("torch FsspecReader load, s3", repeat(s3_reps, nbytes, lambda: dcp.load(
        restored, storage_reader=FsspecReader(f"s3://{bench.bucket}/torch-fsspec"))))  # fmt: skip


def phase_tierstore(bench: Bench, state: Any) -> None:
    reps, nbytes = bench.args.reps, state_bytes(state)
    print("tierstore", flush=True)
    memory = bench.config("memory", namespace="async")
    ram = make_tier(memory.tiers[0], namespace=memory.namespace, node=0)
    commits = Samples(nbytes=nbytes)
    waits: list[float] = []

    def measured(index: int) -> None:
        timings = read_manifest(ram, f"step_{index:06d}").timings
        commits.seconds.append(float(timings["commit_s"] or 0))
        waits.append(float(timings["wait_s"] or 0))
        if index:
            delete_copy(ram, f"step_{index - 1:06d}")  # keep tmpfs use bounded

    writer = TieredWriter(memory)  # one writer, as in a training loop: its buffers are reused
    stalls = async_stalls(state, lambda _index: writer, reps + 1, bench.args.gap, measured)
    bench.record("tierstore async stall (steady)", steady(stalls))
    bench.record("tierstore commit in memory tier (steady)", steady(commits))
    bench.extra["tierstore wait_s (steady)"] = waits[1:]
    restored = zeros_like_state(state)
    last = f"step_{reps:06d}"

    def load(config: Config, checkpoint_id: str) -> Any:
        return lambda: dcp.load(
            restored, storage_reader=TieredReader(config), checkpoint_id=checkpoint_id
        )

    bench.record("tierstore restore from memory", repeat(reps, nbytes, load(memory, last)))
    local = bench.config("local", namespace="local")
    nvme = make_tier(local.tiers[0], namespace=local.namespace, node=0)
    saved = "step_000000"

    def local_save() -> None:
        dcp.save(state, storage_writer=TieredWriter(local), checkpoint_id=saved)

    bench.record(
        "tierstore save to local tier (sync)",
        repeat(reps, nbytes, local_save, setup=lambda: delete_copy(nvme, saved)),
    )
    bench.record("tierstore restore from local", repeat(reps, nbytes, load(local, saved)))
    phase_s3(bench, state, memory=memory, ram=ram, checkpoint_id=last, restored=restored)


def phase_s3(
    bench: Bench, state: Any, *, memory: Config, ram: Any, checkpoint_id: str, restored: Any
) -> None:
    from boto3.s3.transfer import TransferConfig

    s3_reps, nbytes = bench.args.s3_reps, state_bytes(state)
    both = config_from_dict({"namespace": memory.namespace, "tiers": [
        memory.tiers[0].model_dump(), bench.config("s3", namespace="x").tiers[0].model_dump()]})  # fmt: skip
    s3 = make_tier(both.tiers[1], namespace=both.namespace, node=0)
    manifest = read_manifest(ram, checkpoint_id)
    data_bytes = sum(f.size for f in manifest.files)

    def promote() -> None:
        delete_copy(s3, checkpoint_id)
        report = Promoter(both).run_once()
        assert report.promoted and not report.failed, report

    bench.record("tierstore promotion memory -> s3", repeat(s3_reps, data_bytes, promote))
    biggest = max(manifest.files, key=lambda f: f.size)
    source = ram.local_path(f"{checkpoint_id}/{biggest.path}")
    best: Samples | None = None
    for concurrency in (4, 8, 10):
        config = TransferConfig(multipart_chunksize=64 * 2**20, max_concurrency=concurrency)
        samples = repeat(s3_reps, biggest.size, lambda c=config: bench.s3.upload_file(
            source, bench.bucket, "boto3/upload.bin", Config=c))  # fmt: skip
        bench.extra[f"boto3 upload_file, concurrency {concurrency}"] = samples.as_dict()
        if best is None or samples.median < best.median:
            best = samples
    assert best is not None
    bench.record("boto3 upload_file, same bytes (best)", best)
    s3_only = config_from_dict({"namespace": both.namespace, "tiers": [both.tiers[1].model_dump()]})

    def restore() -> None:
        reader = TieredReader(s3_only)
        dcp.load(restored, storage_reader=reader, checkpoint_id=checkpoint_id)

    bench.record("tierstore restore from s3", repeat(s3_reps, nbytes, restore))


def phase_catalog(bench: Bench) -> None:
    from tierstore.manifest import FileEntry, Manifest, crc32c, publish_manifest

    print("catalog", flush=True)
    config = bench.config("memory", "local", "shared", "s3", namespace="catalog")
    tiers = [make_tier(t, namespace=config.namespace, node=0) for t in config.tiers]
    blob = b"metadata"
    for index in range(1, 1001):
        checkpoint_id = f"step_{index * 100:08d}"
        generation = f"g{index:011x}00000000"
        entry = FileEntry(f"{generation}/.metadata", len(blob), crc32c(blob), None, 0)
        manifest = Manifest(checkpoint_id, generation, 1, (entry,), seq=index)
        for tier in tiers:
            tier.write_bytes(f"{checkpoint_id}/{entry.path}", blob)
            publish_manifest(tier, manifest, create_only=False)
    assert latest_committed(config) == "step_00100000"
    bench.record(
        "latest_committed, 1000 checkpoints x 4 tiers",
        repeat(5, 0, lambda: latest_committed(config)),
    )
    bench.record(
        "ls (all markers read), 1000 x 4 tiers", repeat(3, 0, lambda: Catalog(config).listings())
    )


def phase_first_saves(bench: Bench) -> None:
    print("first save in a fresh process", flush=True)
    for kind in ("torch", "tierstore", "tierstore-prepared"):
        samples = Samples(nbytes=parse_size(bench.args.size))
        for _ in range(max(1, bench.args.s3_reps)):
            done = subprocess.run(
                [sys.executable, __file__, "--first-save", kind, "--size", bench.args.size,
                 "--disk-dir", str(bench.shm)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            samples.seconds.append(json.loads(done.stdout.strip().splitlines()[-1])["stall_s"])
        bench.record(f"{kind} async_save stall, first save of a fresh process", samples)


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
    print("scale sweep", flush=True)
    rows = []
    for size in bench.args.sweep:
        state = model_state(parse_size(size))
        nbytes = state_bytes(state)
        memory = bench.config("memory", namespace=f"sweep-{size}")
        ram = make_tier(memory.tiers[0], namespace=memory.namespace, node=0)
        commits: list[float] = []

        def measured(index: int, ram: Any = ram, commits: list[float] = commits) -> None:
            commits.append(float(read_manifest(ram, f"step_{index:06d}").timings["commit_s"] or 0))
            if index:
                delete_copy(ram, f"step_{index - 1:06d}")

        writer = TieredWriter(memory)
        stalls = async_stalls(state, lambda _index, w=writer: w, 3, bench.args.gap, measured)
        manifest = read_manifest(ram, "step_000002")
        local = bench.config("local", namespace=f"sweep-{size}")
        os.sync()  # earlier deletions are trimmed now, not inside the timed fsync
        started = time.perf_counter()
        dcp.save(state, storage_writer=TieredWriter(local), checkpoint_id="step_000000")
        local_s = time.perf_counter() - started
        rows.append({
            "size": size, "bytes": nbytes, "tensors": len(list(tensors_of(state))),
            "stall_s": steady(stalls).median, "commit_s": sorted(commits[1:])[len(commits[1:]) // 2],
            "local_save_s": local_s,
            "files_per_rank": sum(1 for f in manifest.files if f.rank == 0),
        })  # fmt: skip
        row = rows[-1]
        print(
            f"  {size:>7}: stall {row['stall_s']:.3f} s, commit {row['commit_s']:.3f} s, local save"
            f" {local_s:.3f} s, {row['files_per_rank']} files per rank",
            flush=True,
        )
        shutil.rmtree(bench.shm / "ram", ignore_errors=True)
        shutil.rmtree(bench.disk / "nvme", ignore_errors=True)
        del state
    return rows


def ratios(bench: Bench) -> dict[str, dict[str, Any]]:
    r = {name: s.median for name, s in bench.results.items()}
    bw = {name: s.gib_s for name, s in bench.results.items()}
    values = {
        "stall / warm copy": r["tierstore async stall (steady)"] / r["warm copy (reused buffers)"],
        "stall / torch default stall": r["tierstore async stall (steady)"]
        / r["torch async_save stall, default stager (steady)"],
        "memory commit / plain tmpfs write (bandwidth)": bw[
            "tierstore commit in memory tier (steady)"
        ]
        / bw["plain write, tmpfs"],
        "local save / plain write+fsync (bandwidth)": bw["tierstore save to local tier (sync)"]
        / bw["plain write+fsync, disk"],
        "restore from memory / plain tmpfs read (bandwidth)": bw["tierstore restore from memory"]
        / bw["plain read, tmpfs"],
        "restore from local / plain disk read (bandwidth)": bw["tierstore restore from local"]
        / bw["plain read, disk (page cache)"],
        "promotion to s3 / best boto3 upload (bandwidth)": bw["tierstore promotion memory -> s3"]
        / bw["boto3 upload_file, same bytes (best)"],
        "latest_committed, 1000 x 4 tiers (seconds)": r[
            "latest_committed, 1000 checkpoints x 4 tiers"
        ],
    }
    out = {}
    for name, value in values.items():
        op, target = TARGETS[name]
        met = value <= target if op == "<=" else value >= target if op == ">=" else value < target
        out[name] = {"value": value, "target": f"{op} {target}", "met": met}
    extra = {
        "stall / torch FileSystemWriter save": r["tierstore async stall (steady)"]
        / r["torch FileSystemWriter save, disk"],
        "first-save stall / torch first-save stall": r[
            "tierstore async_save stall, first save of a fresh process"
        ]
        / r["torch async_save stall, first save of a fresh process"],
        "restore from s3 / torch FsspecReader (bandwidth)": bw["tierstore restore from s3"]
        / bw["torch FsspecReader load, s3"],
        "local save / torch FileSystemWriter (bandwidth)": bw["tierstore save to local tier (sync)"]
        / bw["torch FileSystemWriter save, disk"],
    }
    for name, value in extra.items():
        out[name] = {"value": value, "target": "(reported)", "met": None}
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = [row["bytes"] / 2**30 for row in rows]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for key, label in (("stall_s", "async stall"), ("commit_s", "commit in memory tier"),
                       ("local_save_s", "save to local tier (sync)")):  # fmt: skip
        axis.plot(gib, [row[key] for row in rows], marker="o", label=label)
    for x, row in zip(gib, rows, strict=True):
        axis.annotate(f"{row['files_per_rank']} files/rank", (x, row["local_save_s"]),
                      textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")  # fmt: skip
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
    parser.add_argument(
        "--gap", type=float, default=2.0, help="seconds of 'training' between saves"
    )
    parser.add_argument("--sweep", nargs="*", default=["256MiB", "512MiB", "1GiB", "2GiB"])
    parser.add_argument("--disk-dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default="bench-results")
    parser.add_argument(
        "--first-save", choices=["torch", "tierstore", "tierstore-prepared"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
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
    with embedded_s3() as endpoint, quiet_warnings():
        bench = Bench(args, endpoint)
        try:
            state = model_state(parse_size(args.size))
            count = len(list(tensors_of(state)))
            print(f"state: {state_bytes(state) / 2**30:.2f} GiB in {count} tensors; {os.cpu_count()} cores;"
                  f" median of {args.reps} (S3: {args.s3_reps})", flush=True)  # fmt: skip
            phase_limits(bench, state)
            phase_torch(bench, state)
            phase_tierstore(bench, state)
            del state
            phase_first_saves(bench)
            phase_catalog(bench)
            rows = phase_sweep(bench) if args.sweep else []
        finally:
            bench.cleanup()
    table = ratios(bench)
    print("\nratios (one run, this machine)")
    for name, row in table.items():
        verdict = {True: "met", False: "MISSED", None: ""}[row["met"]]
        print(f"  {name:<56} {row['value']:8.3f}  {row['target']:>10}  {verdict}")
    report = {
        "machine": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "arguments": vars(args),
        "results": {name: s.as_dict() for name, s in bench.results.items()},
        "extra": bench.extra,
        "ratios": table,
        "sweep": rows,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    if rows:
        plot(rows, out / "sweep.png")
    print(f"\nwrote {out / 'bench.json'}" + (f" and {out / 'sweep.png'}" if rows else ""))


if __name__ == "__main__":
    main()
