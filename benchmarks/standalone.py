"""Tiers stand alone, measured: what a slow or absent S3 tier costs the fast path.

    python benchmarks/standalone.py [--size 256MiB] [--rounds 3] [--out bench-results]

Against a real S3 server (SeaweedFS, started here on loopback) behind a loopback fault proxy, each
figure is measured in a fresh process (a restarted job: no client or knowledge carried over) and the
variants are run in turns, round after round; the table gives medians of per-round time ratios.

* **Restore from memory with S3 configured** against a memory-only configuration: ``latest_committed``
  and ``dcp.load`` of the newest checkpoint, S3 sighted by one promoter pass (target: <= 1.2x); the
  median of repeated calls in the fresh process (its first, cold call is reported too: a few
  milliseconds, dominated by what the process has not loaded yet).
* **Saves while S3 is away**: the stall of ``dcp.async_save`` (until it returns) and the time to
  commit, steady state (saves 2 to 12 of a process), with S3 refusing connections, hanging, or
  answering 503 to everything, against the same configuration with S3 healthy (target: <= 1.1x).
  A single save's stall swings tenfold here with what else the two cores do (page faults, the
  previous save's background write), so these ratios compare the medians of every steady-state save
  of a variant, pooled over the rounds, rather than per-round ratios.
  The first save of a process also takes the start-up look at the other tiers; with a hung S3 that
  look waits ``probe_timeout`` on DCP's background thread (reported, not a target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fault_proxy import FaultProxy
from tests.s3server import seaweed_server
from tierstore.units import parse_size

FAULTS = ("refuse", "hang", "503")
SAVES = 12
RESTORES = 5


def config_yaml(root: Path, proxy: str | None, bucket: str, ram: str = "ram") -> str:
    """A memory tier (in ``root/ram``), and (with ``proxy``) an S3 tier behind the fault proxy."""
    tiers = [{"name": "ram", "type": "memory", "path": str(root / ram), "keep": 2}]
    if proxy is not None:
        tiers.append(
            {
                "name": "s3",
                "type": "s3",
                "url": f"s3://{bucket}/run",
                "endpoint_url": proxy,
                "max_attempts": 3,
                "max_retry_time": "5s",
            }
        )
    body = {"tiers": tiers, "probe_timeout": "3s"}
    path = root / f"tierstore-{ram}-{'s3' if proxy else 'ram'}.yaml"
    path.write_text(json.dumps(body))  # JSON is YAML
    return str(path)


def worker(kind: str, config_path: str, numel: int) -> dict[str, Any]:
    """In the fresh process: time a restore, or a series of async saves."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierstore import TieredReader, TieredWriter, latest_committed, load_config

    config = load_config(config_path)
    if kind == "restore":  # the first call of each (cold), then the median of repeats
        latest, loads, newest = [], [], None
        for _ in range(RESTORES * 4):
            started = time.perf_counter()
            newest = latest_committed(config, collective=False)
            latest.append(time.perf_counter() - started)
        assert newest is not None
        state = {"w": torch.empty(numel)}
        for _ in range(RESTORES):
            started = time.perf_counter()
            reader = TieredReader(config)
            dcp.load(state, storage_reader=reader, checkpoint_id=newest)
            loads.append(time.perf_counter() - started)
        return {
            "latest_s": statistics.median(latest[1:]),
            "load_s": statistics.median(loads[1:]),
            "latest_first_s": latest[0],
            "load_first_s": loads[0],
            "tier": reader.chosen_tier,
        }
    state = {"w": torch.rand(numel)}
    stalls, commits = [], []
    for step in range(SAVES):
        started = time.perf_counter()
        future = dcp.async_save(
            state, storage_writer=TieredWriter(config), checkpoint_id=f"{kind}-{os.getpid()}-{step}"
        )
        stalls.append(time.perf_counter() - started)
        future.result()
        commits.append(time.perf_counter() - started)
    return {"stalls": stalls, "commits": commits}


def run_worker(kind: str, config_path: str, numel: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", kind, config_path, str(numel)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def ratio_table(rows: list[tuple[str, list[float], float]]) -> list[dict[str, Any]]:
    """``(name, per-round ratios, target)`` -> rows with the median and whether it is met."""
    return [
        {
            "figure": name,
            "ratio": statistics.median(ratios),
            "rounds": ratios,
            "target": target,
            "met": statistics.median(ratios) <= target,
        }
        for name, ratios, target in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    numel = parse_size(args.size) // 4
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with tempfile.TemporaryDirectory() as tmp, seaweed_server(Path(tmp) / "weed") as server:
        import boto3

        bucket = "standalone"
        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=bucket)
        url = urlparse(server.endpoint)
        assert url.hostname is not None and url.port is not None
        # The memory tiers live in tmpfs, as on a real node: under a disk directory, their mapped
        # landing files would time the disk's writeback, not the save.
        shm = Path(tempfile.mkdtemp(prefix="tierstore-standalone-", dir="/dev/shm"))
        try:
            with FaultProxy(url.hostname, url.port) as proxy:
                return measure(shm, proxy, bucket, numel, args)
        finally:
            shutil.rmtree(shm, ignore_errors=True)


def measure(shm: Path, proxy: FaultProxy, bucket: str, numel: int, args: Any) -> int:
    from tierstore import load_config
    from tierstore.promote.sidecar import Promoter

    restore: dict[str, list[float]] = {"latest": [], "load": [], "latest_first": [], "load_first": []}
    pooled: dict[str, dict[str, list[float]]] = {m: {"stall": [], "commit": []} for m in ("pass", *FAULTS)}
    first_commit: dict[str, list[float]] = {f: [] for f in ("healthy", *FAULTS)}
    for round_ in range(args.rounds):
        root = shm / f"round{round_}"
        root.mkdir()
        with_s3, ram_only = (config_yaml(root, proxy.endpoint, bucket), config_yaml(root, None, bucket))
        proxy.set_mode("pass")
        run_worker("save", with_s3, numel)  # checkpoints to restore
        Promoter(load_config(with_s3)).run_once()  # S3 sighted, as with the sidecar running
        timed = {
            name: run_worker("restore", path, numel) for name, path in (("s3", with_s3), ("ram", ram_only))
        }
        for what in ("latest", "load", "latest_first", "load_first"):
            restore[what].append(timed["s3"][f"{what}_s"] / timed["ram"][f"{what}_s"])
        # Each variant saves into a memory tier of its own (the same conditions for all), in an
        # order that rotates from round to round.
        variants = ["pass", *FAULTS]
        variants = variants[round_ % 4 :] + variants[: round_ % 4]
        timings: dict[str, dict[str, list[float]]] = {}
        for mode in variants:
            proxy.set_mode(mode)
            timings[mode] = run_worker("save", config_yaml(root, proxy.endpoint, bucket, mode), numel)
            shutil.rmtree(root / mode)
            first_commit["healthy" if mode == "pass" else mode].append(timings[mode]["commits"][0])
        proxy.set_mode("pass")
        for mode in ("pass", *FAULTS):
            for what in ("stall", "commit"):
                pooled[mode][what] += timings[mode][f"{what}s"][1:]
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    rows = [
        ("latest_committed, RAM + S3 vs RAM only", restore["latest"], 1.2),
        ("restore from RAM, RAM + S3 vs RAM only", restore["load"], 1.2),
        ("  the same, first call of a process", restore["latest_first"], 1.2),
        ("  the same, first restore of a process", restore["load_first"], 1.2),
    ]
    for fault in FAULTS:
        for what in ("stall", "commit"):
            ratio = statistics.median(pooled[fault][what]) / statistics.median(pooled["pass"][what])
            rows.append((f"async_save {what}, S3 {fault} vs healthy (pooled)", [ratio], 1.1))
    table = ratio_table(rows)
    for row in table:
        print(
            f"{row['figure']:<48} {row['ratio']:6.2f}x  target <= {row['target']}x"
            f"  {'met' if row['met'] else 'MISSED'}  rounds {[round(r, 2) for r in row['rounds']]}"
        )
    medians = {
        mode: {what: statistics.median(pooled[mode][what]) for what in ("stall", "commit")}
        for mode in ("pass", *FAULTS)
    }
    for mode, found in medians.items():
        print(
            f"steady-state saves, S3 {'healthy' if mode == 'pass' else mode:<8} stall median"
            f" {found['stall']:.3f}s, commit median {found['commit']:.3f}s"
            f" ({len(pooled[mode]['stall'])} saves)"
        )
    for name, values in first_commit.items():
        print(
            f"first save's commit (start-up look included), S3 {name:<8} "
            f"median {statistics.median(values):.2f}s"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "standalone.json").write_text(
        json.dumps(
            {
                "size_bytes": numel * 4,
                "rows": table,
                "first_commit_s": first_commit,
                "steady_medians_s": medians,
                "steady_s": pooled,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        sys.exit(0)
    sys.exit(main())
