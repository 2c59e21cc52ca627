"""A broken drill entry: it restores some other checkpoint than the one the drill asked for."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from train_gpt import drill_entry


def restores_step_4(ctx: Any) -> Iterator[tuple[int, float]]:
    """Restore step 4 whatever the drill named (a stale path in a user's entry, say)."""
    ctx.checkpoint_id = "step_00000004"
    return drill_entry(ctx)
