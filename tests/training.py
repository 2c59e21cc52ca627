"""A realistic training state for round-trip tests: model, AdamW, LR schedule, step, RNG, bytes."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class TinyNet(nn.Module):
    """Small but shaped like a real model: embedding, norm, MLP, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.norm = nn.LayerNorm(32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
        self.register_buffer("counts", torch.arange(8, dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(self.embed(tokens))).mean(dim=1)


class Trainer:
    """Model + AdamW + cosine LR schedule, trainable for a few steps."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = TinyNet()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=100)
        self.step = 0

    def train(self, steps: int) -> float:
        loss = torch.tensor(0.0)
        for _ in range(steps):
            tokens = torch.randint(0, 64, (4, 5))
            loss = self.model(tokens).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        return loss.item()

    def state(self) -> dict[str, Any]:
        """The state dict as a training loop hands it to DCP."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "extra": b"\x00\x01arbitrary bytes\xff" * 3,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Apply a loaded state dict."""
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])


def fresh_target(seed: int = 1234) -> tuple[Trainer, dict[str, Any]]:
    """A differently initialised trainer (one step in, so optimizer state exists) and its state."""
    other = Trainer(seed)
    other.train(1)
    return other, other.state()


def assert_same(left: Any, right: Any, where: str = "state") -> None:
    """Bit-exact equality of nested states (tensors compared byte for byte)."""
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor), where
        assert left.dtype == right.dtype and left.shape == right.shape, where
        assert torch.equal(_bytes_of(left), _bytes_of(right)), where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and set(left) == set(right), f"{where}: {set(left) ^ set(right)}"
        for key in left:
            assert_same(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, list | tuple):
        assert isinstance(right, list | tuple) and len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert left == right, f"{where}: {left!r} != {right!r}"


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
