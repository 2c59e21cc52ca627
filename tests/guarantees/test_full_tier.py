"""A full middle tier (a real, small tmpfs: ENOSPC) does not block durability: promotion routes
around it to S3, says so (metric, log), lets the memory tier trim, and keeps retrying it."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter
from tierstore.cli.audit import audit_all
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter


def save(config: Config, checkpoint_id: str, value: float) -> None:
    state = {"w": torch.full((1_000_000,), value)}  # 4 MB: more than the small tmpfs holds
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def test_promotion_routes_around_a_full_middle_tier(
    small_tmpfs: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config(
        "memory", "local", "s3", tiers={"memory": {"keep": 1}, "local": {"path": str(small_tmpfs)}}
    )
    memory, local, s3 = config.make_tiers(node=0)
    promoter = Promoter(config)
    save(config, "step_000001", 1.0)
    report = promoter.run_once()
    assert any("No space left" in error for _p, error in report.failed), report.failed
    assert promoter.unavailable == {"local"}
    assert promoter.metrics.unavailable.labels("local")._value.get() == 1
    assert s3.exists(marker_path("step_000001")), "S3 got it from memory, around the full disk"
    save(config, "step_000002", 2.0)
    promoter.run_once()
    assert not memory.exists(marker_path("step_000001")), "memory may trim: step 1 is durable"
    assert s3.exists(marker_path("step_000002"))
    assert not local.exists(marker_path("step_000001")), "no marker over what did not fit"
    assert [a for a in audit_all(config, [0]) if not a.ok] == []

    # Space comes back (an operator grows the disk): the next pass uses the tier again.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    promoter.run_once()
    assert local.exists(marker_path("step_000002"))
    assert promoter.unavailable == set()
    assert promoter.metrics.unavailable.labels("local")._value.get() == 0
    assert [a for a in audit_all(config, [0]) if not a.ok] == []
