"""The drill's words, in-process: the one-line cause of a failure, whose arguments were refused, how
close a pass came, and why a drill needs three steps (a wrong LR schedule shows first in the third)."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tierstore.config import Config
from tierstore.dcp.tools.drill import MIN_STEPS, DrillReport, _compare, run_drill
from tierstore.dcp.tools.drill_cause import Tee, exit_cause, failure_cause
from tierstore.errors import CheckpointNotFoundError, IntegrityError, TierstoreError

CORRUPT = "s3 (s3, s3://b/ckpt): step_8/g1/r00001-0.distcp: CRC32C 10f1a2de, marker says 4170053c"


def wrapped(exc: BaseException, rank: int = 0) -> CheckpointException:
    """``exc`` as DCP hands it on: raised, its traceback kept, gathered under the rank."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - wrapping whatever it is, as DCP does
        return CheckpointException("plan", {rank: (caught, traceback.extract_tb(caught.__traceback__))})


def test_a_failed_metadata_read_gives_the_readers_own_line() -> None:
    # DCP keeps only the text of read_metadata's error, inside an AssertionError, on every rank.
    error = CheckpointNotFoundError(
        f"no tier holds a usable committed copy of checkpoint 'step_8':\n  {CORRUPT}"
    )
    dcp_error = wrapped(AssertionError(f"metadata is None; global metadata read failed: {error}"))
    assert len(str(dcp_error).splitlines()) > 3  # what the drill used to print, per rank

    cause = failure_cause(dcp_error, fallback=error)

    assert cause == f"no tier holds a usable committed copy of checkpoint 'step_8': {CORRUPT}"


def test_the_innermost_tierstore_error_wins_through_nested_gathers_and_causes() -> None:
    inner = IntegrityError(f"tier {CORRUPT}")
    try:
        try:
            raise inner
        except IntegrityError as exc:
            raise TierstoreError("reading the checkpoint failed") from exc
    except TierstoreError as outer_error:
        nested = wrapped(wrapped(outer_error, rank=1))
    assert failure_cause(nested, fallback=TierstoreError("not this one")) == f"tier {CORRUPT}"


def test_without_a_tierstore_error_the_innermost_exception_speaks() -> None:
    assert failure_cause(wrapped(RuntimeError("shape mismatch\nfor w"))) == (
        "RuntimeError: shape mismatch; for w"
    )


def refused_arguments(argv: list[str]) -> str:
    """What an entry's own parser prints when it refuses ``argv`` (through the drill's tee)."""
    parser = argparse.ArgumentParser(prog="train_gpt.py")
    parser.add_argument("--config", required=True)
    shown = io.StringIO()
    printed = Tee(shown)
    with contextlib.redirect_stderr(printed), pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert shown.getvalue() == printed.getvalue()  # written through, and kept
    return printed.getvalue()


def test_missing_entry_arguments_are_said_to_be_the_entrys() -> None:
    printed = refused_arguments([])
    cause = exit_cause(SystemExit(2), printed, entry="examples/train_gpt.py:drill_entry", argv=())
    assert cause == (
        "the step function refused its arguments (train_gpt.py: error: the following arguments"
        " are required: --config; none given after --): pass the entry script's own arguments"
        " after --: tierstore drill --entry examples/train_gpt.py:drill_entry ... -- ARGS"
    )
    printed = refused_arguments(["--confg", "x.yaml"])
    cause = exit_cause(SystemExit(2), printed, entry="e.py:f", argv=("--confg", "x.yaml"))
    assert "given after --: --confg x.yaml" in cause


def test_other_exits_say_what_they_said() -> None:
    assert exit_cause(SystemExit("batch must split"), "", entry="e.py:f", argv=("-x",)) == (
        "the step function exited: batch must split"
    )
    assert exit_cause(SystemExit(3), "", entry="e.py:f", argv=("-x",)) == (
        "the step function exited with status 3 (given after --: -x)"
    )


def report(tolerance: float) -> DrillReport:
    return DrillReport("step_8", "s3", 1, False, "", tolerance)


def test_an_exact_pass_says_equal() -> None:
    exact = report(1e-4)
    _compare(exact, [[9, 2.5], [10, 2.25], [11, 2.0]], {9: 2.5, 10: 2.25, 11: 2.0})
    assert exact.passed and exact.reason == "all 3 losses equal the training log's"


def test_a_pass_within_tolerance_does_not_claim_a_match() -> None:
    close = report(0.01)
    _compare(close, [[9, 2.5], [10, 2.2], [11, 2.0]], {9: 2.5, 10: 2.21, 11: 2.0})
    assert close.passed
    assert close.reason == (
        "losses within tolerance 0.01 of the training log, max deviation 0.00452 (relative)"
    )
    assert "match" not in close.reason and "equal" not in close.reason
    assert close.max_relative_error == pytest.approx(0.01 / 2.21)


def test_a_drill_of_fewer_steps_than_show_the_schedule_is_refused(tmp_path: Path) -> None:
    config = Config.model_validate({"tiers": [{"name": "disk", "type": "local", "path": str(tmp_path)}]})
    with pytest.raises(TierstoreError, match=r"--steps 2: expected at least 3\. .*wrong schedule"):
        run_drill(config, entry="m:f", loss_log=tmp_path / "none.jsonl", steps=2)
    assert MIN_STEPS == 3


def resumed_losses(keep_schedule: bool, steps: int = 3) -> list[float]:
    """Train 5 steps, "checkpoint" (state dicts), restore into a fresh job (with or without the
    scheduler's state) and train on: the losses after the restore."""

    def job() -> tuple[torch.nn.Linear, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
        return model, optimizer, schedule

    def step(
        model: torch.nn.Linear,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LambdaLR,
        number: int,
    ) -> float:
        generator = torch.Generator().manual_seed(number)
        inputs = torch.randn(32, 8, generator=generator)
        loss = (model(inputs).squeeze(1) - inputs.sum(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()  # after the optimizer, as PyTorch asks
        return loss.item()

    model, optimizer, schedule = job()
    for number in range(1, 6):
        step(model, optimizer, schedule, number)
    saved = (model.state_dict(), optimizer.state_dict(), schedule.state_dict())
    model, optimizer, schedule = job()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])  # carries the learning rate of the next update
    if keep_schedule:
        schedule.load_state_dict(saved[2])
    return [step(model, optimizer, schedule, number) for number in range(6, 6 + steps)]


def test_a_wrong_lr_schedule_shows_first_in_the_third_steps_loss() -> None:
    right, wrong = resumed_losses(keep_schedule=True), resumed_losses(keep_schedule=False)
    assert right[:2] == wrong[:2]  # a two-step drill cannot tell them apart, at any tolerance
    assert not math.isclose(right[2], wrong[2], rel_tol=1e-3)  # the third step can
