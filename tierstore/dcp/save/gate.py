"""Commit gates: a last look at what a rank is about to commit, with the power to veto it.

Never commit poison: a NaN saved faithfully is reloaded by every restart. ``check_finite: true`` refuses
NaN/Inf in floating tensors; a *commit gate* is any picklable callable taking a :class:`GateView` and
returning ``None`` (commit) or a reason (veto). It runs on every rank, in the background save, after the
rank's data is written and before the commit marker; a veto on any rank fails the save, the future
raises :class:`~tierstore.errors.CommitVetoedError` with the reason, and the previous checkpoint stays
the latest. A gate sees only the items its rank writes: DCP writes a replicated value (a float, an int)
on one rank only, so a gate should ignore keys it does not find.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

CommitGate = Callable[["GateView"], "str | None"]


@dataclass
class GateView:
    """The data one rank is about to commit, keyed by DCP's flattened names (``train.loss``)."""

    checkpoint_id: str
    rank: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, io.BytesIO] = field(default_factory=dict)

    def value(self, fqn: str, default: Any = None) -> Any:
        """A non-tensor item (``float``, ``int``, ``dict``...) as saved, or a tensor, or ``default``."""
        if fqn in self.tensors:
            return self.tensors[fqn]
        if fqn not in self.objects:
            return default
        buffer = self.objects[fqn]
        buffer.seek(0)
        try:
            # Our own process's bytes, produced by DCP's planner a moment ago: trusted input.
            return torch.load(buffer, weights_only=False)
        finally:
            buffer.seek(0)


@dataclass(frozen=True)
class LossBandGate:
    """Veto when ``loss`` is not finite or strays beyond ``band`` x its saved running average.

    The running average travels in the checkpoint itself (``avg_key``), so the gate keeps no state and
    works in DCP's checkpoint process too. Ranks that do not write these keys do not vote.
    """

    loss_key: str = "train.loss"
    avg_key: str = "train.loss_avg"
    band: float = 3.0

    def __call__(self, view: GateView) -> str | None:
        """Return a reason to veto, or None."""
        loss = view.value(self.loss_key)
        if loss is None:
            return None
        loss = float(loss)
        if not math.isfinite(loss):
            return f"{self.loss_key} is {loss}"
        average = view.value(self.avg_key)
        if average is not None and float(average) > 0 and loss > self.band * float(average):
            return f"{self.loss_key}={loss:.4g} exceeds {self.band}x its average {float(average):.4g}"
        return None
