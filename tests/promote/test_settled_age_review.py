"""Review of the second settle rule (:data:`tierstore.promote.discovery.SETTLED_AGE`): the clock
probe it adds before reading old markers is a write, and a tier that refuses writes (full, or
read-only) must still be listed as before: promotions route around it, they do not lose it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter

HOUR = 3600.0


def _read_only(where: Path) -> None:
    """Remount the tier's filesystem read-only (a real EROFS on every write)."""
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


def test_a_read_only_tier_with_old_markers_is_still_listed(
    mount_tmpfs: Callable[[str], Path], make_config: Callable[..., Config]
) -> None:
    where = mount_tmpfs("4m")
    config = make_config("local", tiers={"local": {"path": str(where)}})
    (local,) = config.make_tiers(node=0)
    dcp.save({"w": torch.zeros(4)}, storage_writer=TieredWriter(config), checkpoint_id="step_000001")
    marker = local.local_path(marker_path("step_000001"))  # type: ignore[attr-defined]
    old = os.stat(marker).st_mtime - HOUR  # committed an hour ago: past SETTLED_AGE by any clock
    os.utime(marker, (old, old))
    _read_only(where)

    promoter = Promoter(config)  # a promoter restarted while the tier is read-only: nothing cached
    promoter.look()
    assert "local" not in promoter.unreachable, promoter.context.availability.unreachable
    assert "step_000001" in promoter.view.found.get("local", {}), "its copy is in the view"
