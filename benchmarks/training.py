"""A training loop of known cost that checkpoints every N steps, for :mod:`benchmarks.goodput`.

The model is a stack of square ``Linear`` layers trained with AdamW, so the training state (parameters
and the two moments) is three times the parameters' bytes and a step's cost is fixed by the batch. Each
checkpointing *variant* follows one waiting rule, the one its documentation prescribes:

* a save's ``async_save`` call blocks the loop for as long as it takes to return;
* an ``AsyncSaveResponse``'s ``staging_completion`` is waited on just before ``optimizer.step()`` (the
  state may be modified from then on), so the copy overlaps the next forward and backward passes;
* before a new save, the previous one's upload is waited on (raises if it failed), as
  docs/usage.md's loop does; so at most one save is in flight.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tierstore import TieredWriter
from tierstore.promote.retention import delete_copy
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

HIDDEN = 1024


class Stack(nn.Module):
    """``layers`` square Linear layers with ReLUs between them."""

    def __init__(self, layers: int, hidden: int = HIDDEN) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.body = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def layers_for(state_bytes: int, hidden: int = HIDDEN) -> int:
    """Layers whose training state (fp32 parameters and two AdamW moments) is about ``state_bytes``."""
    per_layer = (hidden * hidden + hidden) * 4 * 3
    return max(1, round(state_bytes / per_layer))


class Trainer:
    """The model, its optimizer, a fixed batch; :meth:`step` is one training step."""

    def __init__(self, state_bytes: int, batch: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = Stack(layers_for(state_bytes))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.batch = torch.randn(batch, HIDDEN)

    def forward_backward(self) -> None:
        loss = self.model(self.batch).pow(2).mean()
        loss.backward()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep the gradients' memory: steps stay alike

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: references to the live tensors, nothing copied."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def state_bytes(self) -> int:
        tensors = [p for p in self.model.parameters()]
        tensors += [t for s in self.optimizer.state.values() for t in s.values() if t.dim()]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclasses.dataclass
class Variant:
    """One way of checkpointing: how to start a save, and how to drop an old one (untimed)."""

    name: str
    mode: AsyncCheckpointerType | None
    save: Callable[[dict[str, Any], str], Future[Any] | AsyncSaveResponse] | None
    drop: Callable[[str], None]


def tierstore_variant(name: str, writer: TieredWriter, tier: Tier, mode: AsyncCheckpointerType) -> Variant:
    def save(state: dict[str, Any], checkpoint_id: str) -> Future[Any] | AsyncSaveResponse:
        return dcp.async_save(
            state, storage_writer=writer, checkpoint_id=checkpoint_id, async_checkpointer_type=mode
        )

    return Variant(
        name, mode, save, lambda checkpoint_id: delete_copy(tier, checkpoint_id, trust=MarkerTrust())
    )


def torch_variant(name: str, root: Path, mode: AsyncCheckpointerType, stager: Any = None) -> Variant:
    """torch's ``FileSystemWriter`` into ``root/<id>``; ``stager`` None is torch's default stager."""

    def save(state: dict[str, Any], checkpoint_id: str) -> Future[Any] | AsyncSaveResponse:
        return dcp.async_save(
            state,
            storage_writer=FileSystemWriter(str(root / checkpoint_id)),
            async_checkpointer_type=mode,
            async_stager=stager,
        )

    return Variant(name, mode, save, lambda checkpoint_id: shutil.rmtree(root / checkpoint_id))


@dataclasses.dataclass(frozen=True)
class Run:
    """One timed loop: wall time less the untimed retention, and the time spent blocked by saves."""

    variant: str
    wall_s: float
    blocked_s: float
    saves: int


def run_loop(trainer: Trainer, variant: Variant, steps: int, every: int, tag: str) -> Run:
    """``steps`` training steps, saving after every ``every``-th; the last ``every`` steps save nothing.

    The clock runs from the first step to the last save's commit (waited for at the end, inside the
    window, so a slow upload is not excused). Deleting old checkpoints is taken off the clock: a
    deployment does it elsewhere (tierstore's promoter), and it would cost both sides alike.
    """
    response: Future[Any] | AsyncSaveResponse | None = None
    saved: list[str] = []
    untimed = blocked = 0.0
    started = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.forward_backward()
        if isinstance(response, AsyncSaveResponse):
            waited = time.perf_counter()
            response.staging_completion.result()  # before anything modifies the state
            blocked += time.perf_counter() - waited
        trainer.update()
        if variant.save is not None and step % every == 0 and step <= steps - every:
            waited = time.perf_counter()
            if response is not None:
                _upload(response).result()  # at most one save in flight
            dropping = time.perf_counter()
            if len(saved) > 1:  # retention: the last two (one committed, one about to be)
                variant.drop(saved.pop(0))
            saving = time.perf_counter()
            saved.append(f"step_{tag}_{step:06d}")
            response = variant.save(trainer.state(), saved[-1])
            blocked += (dropping - waited) + (time.perf_counter() - saving)
            untimed += saving - dropping
    if response is not None:
        waited = time.perf_counter()
        _upload(response).result()
        blocked += time.perf_counter() - waited
    wall = time.perf_counter() - started - untimed
    for checkpoint_id in saved:
        variant.drop(checkpoint_id)
    return Run(variant.name, wall, blocked, len(saved))


def _upload(response: Future[Any] | AsyncSaveResponse) -> Future[Any]:
    return response.upload_completion if isinstance(response, AsyncSaveResponse) else response
