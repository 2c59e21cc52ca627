"""The example's commit gate: a runaway loss stays vetoed for as long as it lasts, not 3 steps."""

from __future__ import annotations

import io
import sys

import torch

from tests.examples.gpt_runs import REPO
from tierstore import GateView, LossBandGate

sys.path.insert(0, str(REPO / "examples"))

from gpt.state import Progress


def view(progress: Progress) -> GateView:
    """What the gate sees of a save taken now (the example saves these two values)."""
    objects = {}
    for key, value in (("train.loss", progress.loss), ("train.loss_avg", progress.loss_avg)):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        objects[key] = buffer
    return GateView("step_x", 0, objects=objects)


def test_a_sustained_divergence_is_vetoed_at_every_save() -> None:
    gate, progress = LossBandGate(band=3.0), Progress()
    for loss in (4.0, 3.8, 3.6, 3.5, 3.4, 3.3):
        progress.record(loss, 16, band=3.0)
        assert gate(view(progress)) is None
    for _ in range(40):  # diverged: 50x and staying there
        progress.record(165.0, 16, band=3.0)
        assert gate(view(progress)) is not None, f"committed a runaway loss at {progress.step}"
    assert progress.loss_avg < 4.0  # the outliers never entered the average


def test_a_non_finite_loss_is_vetoed_and_does_not_poison_the_average() -> None:
    gate, progress = LossBandGate(band=3.0), Progress()
    progress.record(3.0, 16, band=3.0)
    progress.record(float("nan"), 16, band=3.0)
    assert gate(view(progress)) is not None
    progress.record(2.9, 16, band=3.0)
    assert gate(view(progress)) is None and progress.loss_avg == 0.9 * 3.0 + 0.1 * 2.9
