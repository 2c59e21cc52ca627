"""The whole training state as one DCP ``Stateful``, and a load planner for per-rank entries.

Saved under one top-level key (``train``), flattened by DCP to names such as ``train.model.*``,
``train.optim.*``, ``train.sched.*``, ``train.progress.step``, ``train.loss`` (what
:class:`tierstore.LossBandGate` reads) and ``train.rng.rank<N>.*``. Model and AdamW go through
``get_state_dict`` / ``set_state_dict``, so the same checkpoint loads at any world size. Random
number generator states are per rank: each rank saves its own under its own rank's key, so no two
ranks write the same name.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger("train_gpt")
EMA = 0.9
"""Weight of the history in the running loss average the commit gate compares against."""


@dataclass
class Progress:
    """How far the run got: optimizer steps taken and global samples consumed."""

    step: int = 0
    samples_seen: int = 0
    loss: float = float("nan")
    loss_avg: float = 0.0

    def record(self, loss: float, batch: int, band: float) -> None:
        """Count one step of ``batch`` global samples whose mean loss was ``loss``.

        The running average (what the commit gate compares with) takes in only losses within
        ``band`` x itself: a runaway loss must not drag the average up until it looks normal and the
        gate lets it be committed.
        """
        self.step += 1
        self.samples_seen += batch
        self.loss = loss
        if self.loss_avg == 0.0:
            self.loss_avg = loss if math.isfinite(loss) else 0.0
        elif math.isfinite(loss) and loss <= band * self.loss_avg:
            self.loss_avg = EMA * self.loss_avg + (1 - EMA) * loss


def rng_snapshot() -> dict[str, Any]:
    """Every generator this process draws from: python, numpy, torch CPU, and CUDA where present."""
    snapshot: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        snapshot["cuda"] = torch.cuda.get_rng_state_all()
    return snapshot


def rng_restore(snapshot: dict[str, Any]) -> None:
    """Put back what :func:`rng_snapshot` took."""
    random.setstate(snapshot["python"])
    np.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch"])
    if "cuda" in snapshot and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(snapshot["cuda"])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) alike."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class TrainState(Stateful):
    """Model, optimizer, LR schedule, progress and this rank's RNG states, saved and loaded as one."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        rank: int,
        seed: int,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rank, self.seed = rank, seed
        self.progress = Progress()

    def state_dict(self) -> dict[str, Any]:
        """What DCP saves (and, on load, the structure it fills in)."""
        model, optim = get_state_dict(self.model, self.optimizer)
        return {
            "model": model,
            "optim": optim,
            "sched": self.scheduler.state_dict(),
            "progress": {"step": self.progress.step, "samples_seen": self.progress.samples_seen},
            "loss": self.progress.loss,
            "loss_avg": self.progress.loss_avg,
            "rng": {f"rank{self.rank}": rng_snapshot()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a loaded checkpoint; a rank the checkpoint has no RNG state for reseeds."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.scheduler.load_state_dict(state_dict["sched"])
        progress = state_dict["progress"]
        self.progress = Progress(
            int(progress["step"]),
            int(progress["samples_seen"]),
            float(state_dict["loss"]),
            float(state_dict["loss_avg"]),
        )
        own = state_dict["rng"].get(f"rank{self.rank}")
        if own is None:
            # Saved at a smaller world size: this rank had no stream. Derive one from the step, so
            # that the same resume is still repeatable.
            seed_everything(self.seed + 7919 * self.progress.step + self.rank)
            logger.info("rank %d: no saved RNG state; reseeded for step %d", self.rank, self.progress.step)
        else:
            rng_restore(own)


class ResumePlanner(DefaultLoadPlanner):
    """DCP's planner, except that RNG entries of ranks the checkpoint never had are not requested.

    Resuming at a larger world size than the save's is then possible; every other key must still be
    in the checkpoint (DCP raises on a missing model or optimizer entry).
    """

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        """Drop this rank's RNG entry when the checkpoint has none, then plan as usual."""
        if metadata is not None:
            streams = state_dict["train"]["rng"]
            for key in list(streams):
                prefix = f"train.rng.{key}."
                if not any(name.startswith(prefix) for name in metadata.state_dict_metadata):
                    del streams[key]
        super().set_up_planner(state_dict, metadata, is_coordinator)
