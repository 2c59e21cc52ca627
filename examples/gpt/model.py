"""A small character-level GPT: token and position embeddings, pre-norm causal self-attention blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelShape:
    """The model's hyperparameters (part of what a resumed run must repeat exactly)."""

    vocab: int
    context: int = 64
    width: int = 96
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1


class Block(nn.Module):
    """Causal self-attention then an MLP, each behind a LayerNorm and a residual connection."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads, self.dropout = shape.heads, shape.dropout
        self.norm1 = nn.LayerNorm(shape.width)
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.proj = nn.Linear(shape.width, shape.width)
        self.norm2 = nn.LayerNorm(shape.width)
        self.mlp = nn.Sequential(
            nn.Linear(shape.width, 4 * shape.width),
            nn.GELU(),
            nn.Linear(4 * shape.width, shape.width),
            nn.Dropout(shape.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        attended = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        mixed: torch.Tensor = x + self.mlp(self.norm2(x))
        return mixed


class CharGPT(nn.Module):
    """Predicts the next character of every position of a window of ``shape.context`` characters."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tokens = nn.Embedding(shape.vocab, shape.width)
        self.positions = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.Sequential(*(Block(shape) for _ in range(shape.layers)))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        where = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tokens(tokens) + self.positions(where)
        logits: torch.Tensor = self.head(self.norm(self.blocks(x)))
        return logits


def next_char_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-character predictions."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
