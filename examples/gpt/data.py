"""The corpus and a sampler that resumes from any global sample offset, at any world size.

Sample ``i`` of the run is a fixed window of text: epoch ``i // windows`` shuffles the windows with a
generator seeded by (seed, epoch), and position ``i % windows`` picks one. So the data a step sees
depends only on the global sample offset, never on how many ranks share the step or on what ran
before: a resume continues at the exact sample, and needs no sampler state beyond that offset.
"""

from __future__ import annotations

from pathlib import Path

import torch


class CharCorpus:
    """A text file as character ids, cut into non-overlapping windows of ``context + 1`` chars."""

    def __init__(self, path: Path, context: int, seed: int) -> None:
        text = path.read_text(encoding="ascii")
        self.alphabet = sorted(set(text))
        lookup = {char: index for index, char in enumerate(self.alphabet)}
        self.ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.context, self.seed = context, seed
        self.windows = (len(self.ids) - 1) // context
        if self.windows < 1:
            raise ValueError(f"{path}: too short for a context of {context} characters")
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.windows, generator=generator)}
        return self._orders[epoch]

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of global samples ``first .. first + count - 1``."""
        starts = []
        for sample in range(first, first + count):
            epoch, position = divmod(sample, self.windows)
            starts.append(int(self._order(epoch)[position]) * self.context)
        rows = torch.stack([self.ids[s : s + self.context + 1] for s in starts])
        return rows[:, :-1], rows[:, 1:]
