"""One view of the tiers per process: a sick tier costs a restart its deadline once, and a restore
touches only the tiers it reads.

Real components only: moto's S3 server behind the loopback fault proxy (``tests/fault_proxy.py``)
for an endpoint that accepts connections and never answers, the counting S3 server
(``tests/request_counter.py``) for what a restore asks of a healthy S3, and the restarted trainer
as a fresh process (``tests/guarantees/restart_child.py``): nothing it knew before is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.fault_proxy import FaultProxy
from tests.request_counter import CountingS3
from tierstore import TieredReader, TieredWriter, load_config
from tierstore.records import known

ROOT = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT = 2.0


def write_config(tmp_path: Path, endpoint: str, bucket: str) -> Path:
    """memory -> s3 (at ``endpoint``), with a short ``probe_timeout``; the YAML's path."""
    path = tmp_path / "tierstore.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"name": "ram", "type": "memory", "path": str(tmp_path / "ram")},
                    {
                        "name": "s3",
                        "type": "s3",
                        "url": f"s3://{bucket}/run",
                        "endpoint_url": endpoint,
                        "max_attempts": 2,
                        "read_timeout": "30s",
                    },
                ],
                "probe_timeout": f"{PROBE_TIMEOUT}s",
            }
        )
    )
    return path


def restart(config_path: Path) -> tuple[dict[str, Any], str]:
    """A fresh trainer process's result line and its log."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.guarantees.restart_child", str(config_path)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_restart_with_a_hung_s3_waits_for_it_at_most_once(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    """S3 accepts connections and never answers; host memory holds the newest checkpoint. From
    ``latest_committed`` to the first committed save, the restarted trainer waits for S3 one
    ``probe_timeout`` (today's code: one per operation, 4-5 of them), and says so in one line."""
    upstream = urlparse(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        config_path = write_config(tmp_path, proxy.endpoint, s3_bucket)
        config = load_config(config_path)
        dcp.save(
            {"w": torch.ones(1000), "step": 7}, storage_writer=TieredWriter(config), checkpoint_id="step_0007"
        )
        proxy.set_mode("hang")
        result, log = restart(config_path)
    print(result, log, sep="\n")
    assert (result["restored"], result["tier"], result["step"]) == ("step_0007", "ram", 8)
    assert result["seconds"] < 1.5 * PROBE_TIMEOUT, result
    about_s3 = [line for line in log.splitlines() if line.startswith("WARNING") and "s3" in line]
    assert len(about_s3) == 1, about_s3


def test_a_second_process_of_the_node_reads_the_first_ones_verdict_instead_of_waiting(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    """Ranks of one node share one probe: the first restarted process waits for the hung S3 once;
    the next one (another rank, a restart moments later) reads its verdict and waits not at all."""
    upstream = urlparse(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        config_path = write_config(tmp_path, proxy.endpoint, s3_bucket)
        dcp.save(
            {"w": torch.ones(1000), "step": 7},
            storage_writer=TieredWriter(load_config(config_path)),
            checkpoint_id="step_0007",
        )
        proxy.set_mode("hang")
        first, _ = restart(config_path)
        second, log = restart(config_path)
    print(first, second, log, sep="\n")
    assert first["seconds"] >= PROBE_TIMEOUT, first  # it found S3 away itself
    assert second["seconds"] < 0.5 * PROBE_TIMEOUT, second
    about_s3 = [line for line in log.splitlines() if line.startswith("WARNING") and "s3" in line]
    assert len(about_s3) == 1 and "of this node" in about_s3[0], about_s3


def test_a_restore_from_memory_asks_nothing_of_a_healthy_s3(tmp_path: Path) -> None:
    """S3 is configured and answers; the checkpoint was never promoted and no promoter runs. A
    restore served by host memory announces itself (its read record) in memory only: no PUT and
    DELETE in S3 (today's code: 3 requests). It still reads S3's marker (one GET, a 404): without a
    fresh sighting nothing in memory says that S3 holds no newer commit of the id (a ``tier=`` save
    straight into S3), and an older copy must never shadow it. With the promoter's sightings fresh,
    S3 is not asked at all (tests/guarantees/test_outage.py counts that)."""
    with CountingS3() as s3:
        bucket = f"ts-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket=bucket)
        config = load_config(write_config(tmp_path, s3.endpoint, bucket))
        dcp.save({"w": torch.ones(8)}, storage_writer=TieredWriter(config), checkpoint_id="x")
        known._KNOWN.get().clear()  # a new process: nothing known of S3
        target = {"w": torch.zeros(8)}
        reader = TieredReader(config)
        with s3.counting() as seen:
            dcp.load(target, storage_reader=reader, checkpoint_id="x")
    print(f"restore from {reader.chosen_tier}: {seen.total} S3 requests {seen.by_operation}")
    assert reader.chosen_tier == "ram" and torch.equal(target["w"], torch.ones(8))
    assert dict(seen.by_operation) == {"GET object": 1}, seen.by_operation


def test_a_newer_commit_only_in_s3_is_restored_from_s3_announced_there(tmp_path: Path) -> None:
    """An overwrite committed straight into S3 is newer than host memory's copy: the restore reads
    S3's marker, serves S3's generation (never memory's older one), and announces its read record
    in S3 before it reads there (PUT, then DELETE once read)."""
    with CountingS3() as s3:
        bucket = f"ts-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket=bucket)
        config = load_config(write_config(tmp_path, s3.endpoint, bucket))
        dcp.save({"w": torch.ones(8)}, storage_writer=TieredWriter(config), checkpoint_id="x")
        newer = TieredWriter(config, tier="s3", overwrite=True)
        dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=newer, checkpoint_id="x")
        known._KNOWN.get().clear()  # a new process: nothing known of S3
        target = {"w": torch.zeros(8)}
        reader = TieredReader(config)
        with s3.counting() as seen:
            dcp.load(target, storage_reader=reader, checkpoint_id="x")
    print(f"restore from {reader.chosen_tier}: {seen.total} S3 requests {seen.by_operation}")
    assert reader.chosen_tier == "s3" and torch.equal(target["w"], torch.full((8,), 2.0))
    assert seen.by_operation["PUT object"] >= 1 and seen.by_operation["DELETE object"] >= 1, seen.by_operation
