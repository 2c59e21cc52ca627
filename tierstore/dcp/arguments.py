"""The arguments of the commands that load torch (``restore``, ``drill``), checked without it: the CLI
checks them before it imports torch (seconds), :mod:`tierstore.dcp.tools` again for its own callers."""

from __future__ import annotations

import math
from pathlib import Path

from tierstore.config import Config
from tierstore.errors import TierstoreError
from tierstore.ids import validate_checkpoint_id

MIN_STEPS = 3
"""The fewest steps a drill runs: the third step's loss is the first that shows the restored LR
schedule (see :mod:`tierstore.dcp.tools.drill`)."""


def check_drill_arguments(
    config: Config,
    *,
    entry: str,
    loss_log: Path,
    world_size: int,
    steps: int,
    tier: str | None,
    checkpoint_id: str | None,
    tolerance: float,
    timeout_s: float,
) -> None:
    """Raise :class:`~tierstore.errors.TierstoreError` (a ``ConfigError`` for an unknown tier, an
    ``InvalidCheckpointIdError`` for a bad id) naming the first argument that cannot work."""
    if world_size < 1:
        raise TierstoreError(f"drill: --world-size {world_size}: expected at least 1")
    if steps < MIN_STEPS:
        raise TierstoreError(
            f"drill: --steps {steps}: expected at least {MIN_STEPS}. The first step's loss comes"
            " before any update, the second after one update at the learning rate the optimizer"
            " restored; only the third shows the restored LR schedule, so fewer steps pass a wrong"
            " schedule"
        )
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise TierstoreError(f"drill: --tolerance {tolerance}: expected a finite number >= 0")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise TierstoreError(f"drill: --timeout {timeout_s}: expected a number of seconds > 0")
    if tier is not None:
        config.tier(tier)  # ConfigError naming the known tiers
    if checkpoint_id is not None:
        validate_checkpoint_id(checkpoint_id)
    target, sep, name = entry.rpartition(":")
    if not sep or not target or not name:
        raise TierstoreError(f"--entry {entry!r}: expected module:function or file.py:function")
    try:
        with open(loss_log, "rb"):
            pass
    except OSError as exc:
        raise TierstoreError(f"loss log {loss_log}: {exc.strerror or exc}") from None


def check_export_destination(destination: Path) -> None:
    """Refuse a ``destination`` that a directory published by a rename would replace: anything but
    nothing or an empty directory (a symbolic link included). Raises :class:`FileExistsError`."""
    if destination.is_symlink():
        raise FileExistsError(f"{destination}: is a symbolic link; name a new directory")
    if destination.exists():
        if not destination.is_dir():
            raise FileExistsError(f"{destination}: exists and is not a directory")
        if any(destination.iterdir()):
            raise FileExistsError(
                f"{destination}: exists and is not empty; export writes only a new or empty"
                " directory (remove it, or choose another)"
            )
