"""A tiny training job for drill tests: a linear model fitted by plain gradient descent.

:func:`train` runs in the test (a checkpoint after every step, a JSON-lines loss log); :func:`drill`
is the step function ``tierstore drill --entry tests/dcp/tiny_drill_entry.py:drill -- --config F``
calls in each rank. Like a real training script it parses its own flags, ``--config`` required.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter
from tierstore.config import Config

WIDTH = 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="tierstore YAML configuration")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    return parser


def step(weights: torch.Tensor, number: int, lr: float) -> float:
    """One update on step ``number``'s batch; returns the loss before it."""
    generator = torch.Generator().manual_seed(number)
    inputs = torch.randn(16, WIDTH, generator=generator)
    targets = inputs @ torch.arange(WIDTH, dtype=torch.float32)
    weights.requires_grad_(True)
    loss = ((inputs @ weights - targets) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        assert weights.grad is not None
        weights -= lr * weights.grad
    weights.grad = None
    return float(loss.detach())


def train(config: Config, steps: int, loss_log: Path, lr: float = 0.05) -> None:
    """``steps`` steps, each logged and checkpointed as ``step_NNNN``."""
    weights = torch.zeros(WIDTH)
    with loss_log.open("w", encoding="utf-8") as log:
        for number in range(1, steps + 1):
            log.write(json.dumps({"step": number, "loss": step(weights, number, lr)}) + "\n")
            state = {"w": weights.detach().clone(), "step": number}
            dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id=f"step_{number:04d}")


def drill(ctx: Any) -> Iterator[tuple[int, float]]:
    """Restore the drill's checkpoint, then train ``ctx.steps`` steps."""
    args = build_parser().parse_args(list(ctx.argv))
    state: dict[str, Any] = {"w": torch.zeros(WIDTH), "step": 0}
    with ctx.restoring():
        dcp.load(state, storage_reader=ctx.reader, checkpoint_id=ctx.checkpoint_id)
    weights = state["w"]
    for offset in range(1, ctx.steps + 1):
        number = state["step"] + offset
        yield number, step(weights, number, args.lr)
