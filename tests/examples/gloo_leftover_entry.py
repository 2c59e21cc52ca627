"""A drill entry that ends with gloo work still in flight, in a group torch keeps alive.

``drill_entry`` turns on deterministic algorithms after the drill joined its group; torch 2.13 then
keeps that gloo group alive past ``destroy_process_group``. Work left running in it is torn down by
gloo's threads during interpreter shutdown, which needs the GIL and aborts the process (SIGABRT).
A drill rank must not die of that once it has reported.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from train_gpt import drill_entry


def leaves_work_in_flight(ctx: Any) -> Iterator[tuple[int, float]]:
    """The example's step function, then collectives nobody waits for."""
    yield from drill_entry(ctx)
    for _ in range(64):
        dist.all_reduce(torch.ones(4), async_op=True)
