"""``tierstore drill`` as a person runs it, on a tiny job: what the verdict says.

A corrupt copy fails in one line naming the file and its checksums (the tracebacks only with
``-v``); missing entry arguments are said to be the entry's, with how to pass them; a pass within
tolerance says how close it came; fewer steps than can show the LR schedule are refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.dcp.tiny_drill_entry import train
from tierstore.config import load_config

pytestmark = pytest.mark.timeout(300)
ENTRY = f"{Path(__file__).with_name('tiny_drill_entry.py')}:drill"


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, Path]:
    """A job of 8 steps, a checkpoint after each; its configuration and loss log."""
    config = tmp_path / "tierstore.yaml"
    tier = {"name": "disk", "type": "local", "path": str(tmp_path / "disk"), "keep": 10}
    config.write_text(yaml.safe_dump({"namespace": "tiny", "tiers": [tier]}))
    log = tmp_path / "loss.jsonl"
    train(load_config(config), 8, log)
    return config, log


def drill(
    config: Path, log: Path, *flags: str, entry_args: tuple[str, ...] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = ("--config", str(config)) if entry_args is None else entry_args
    command = [
        sys.executable,
        "-m",
        "tierstore.cli",
        "--config",
        str(config),
        "drill",
        "--entry",
        ENTRY,
        "--loss-log",
        str(log),
        "--checkpoint",
        "step_0004",
        *flags,
        "--",
        *argv,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)


def test_an_exact_pass_says_the_losses_equal_the_log(trained: tuple[Path, Path]) -> None:
    done = drill(*trained)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == (
        "drill PASS: step_0004 from disk at world size 1: all 3 losses equal the training log's"
    )


def test_a_pass_within_tolerance_says_how_close_not_that_every_loss_matches(
    trained: tuple[Path, Path],
) -> None:
    config, log = trained
    done = drill(config, log, entry_args=("--config", str(config), "--lr", "0.0500001"))
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = done.stdout.splitlines()[0]
    assert verdict.startswith(
        "drill PASS: step_0004 from disk at world size 1: losses within tolerance 0.0001 of the"
        " training log, max deviation "
    ), verdict
    assert "match" not in verdict


def test_a_corrupt_copy_fails_in_one_line_naming_the_file(trained: tuple[Path, Path]) -> None:
    config, log = trained
    data = next((config.parent / "disk" / "tiny" / "step_0004").rglob("r00000-0.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))

    done = drill(config, log)

    assert done.returncode == 1
    out = done.stdout.splitlines()
    assert len(out) == 3, done.stdout  # verdict, timings, the Prometheus line: no traceback
    assert out[0].startswith("drill FAIL: step_0004 from disk at world size 1: rank 0: ")
    assert "r00000-0.distcp: CRC32C " in out[0] and ", marker says " in out[0], out[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert len(done.stderr.splitlines()) <= 3, done.stderr  # each rank's warnings, one line each

    verbose = drill(config, log, "-v")
    assert verbose.returncode == 1
    assert verbose.stdout.splitlines()[0] == out[0]
    assert "Traceback (most recent call last)" in verbose.stdout


def test_missing_entry_arguments_are_the_entrys_not_tierstores(trained: tuple[Path, Path]) -> None:
    done = drill(*trained, entry_args=())
    assert done.returncode == 1
    verdict = done.stdout.splitlines()[0]
    assert verdict.startswith(
        "drill FAIL: step_0004 from disk at world size 1: rank 0: the step function refused its"
        " arguments (tiny_drill_entry.py: error: the following arguments are required: --config;"
        " none given after --): pass the entry script's own arguments after --: tierstore drill"
        f" --entry {ENTRY} ... -- ARGS"
    ), verdict
    assert "tierstore: error" not in done.stderr and "usage: tierstore" not in done.stderr


def test_fewer_steps_than_show_the_lr_schedule_are_refused(trained: tuple[Path, Path]) -> None:
    done = drill(*trained, "--steps", "2")
    assert done.returncode == 2
    assert done.stderr.startswith("tierstore: error: drill: --steps 2: expected at least 3.")
    assert "a wrong schedule" in done.stderr and done.stderr.count("\n") == 1
