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
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.fault_proxy import FaultProxy
from tierstore import TieredWriter, load_config

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
