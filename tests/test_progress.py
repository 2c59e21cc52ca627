"""Progress bars: on a terminal for restores, verifications and promotions; nothing in logs or pipes."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.training import Trainer
from tierstore import TieredWriter
from tierstore._platform import progress as progress_module
from tierstore._platform.progress import ByteProgress
from tierstore.cli import main
from tierstore.config import load_config
from tierstore.dcp.tools import export as export_module
from tierstore.promote.sidecar import Promoter


class Terminal(io.StringIO):
    """What a bar writes to, taken for an interactive terminal."""

    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_counts_to_the_total() -> None:
    screen = Terminal()
    with ByteProgress("restore step_1 from s3", 4 * 2**20, stream=screen, delay=0) as bar:
        assert bar.shown
        bar.update(2**20)
        bar.update(3 * 2**20)
        assert bar.done == 4 * 2**20
    drawn = screen.getvalue()
    assert "restore step_1 from s3" in drawn and "/4.00M" in drawn


@pytest.mark.parametrize("stream, enabled", [(io.StringIO(), True), (Terminal(), False)])
def test_no_bar_in_a_pipe_or_log_or_when_not_asked(stream: io.StringIO, enabled: bool) -> None:
    with ByteProgress("verify x", 100, stream=stream, enabled=enabled, delay=0) as bar:
        bar.update(100)
        assert not bar.shown and bar.done == 100
    assert stream.getvalue() == ""


def test_a_quick_operation_shows_no_bar_before_its_delay() -> None:
    screen = Terminal()
    with ByteProgress("promote x", 100, stream=screen, delay=60) as bar:
        bar.update(100)
    assert "promote x" not in screen.getvalue()


@pytest.fixture
def config_file(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]) -> Path:
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": tier_specs("memory", "local")}))
    trainer = Trainer(seed=0)
    trainer.train(1)
    dcp.save(trainer.state(), storage_writer=TieredWriter(str(path)), checkpoint_id="step_1")
    return path


def as_terminal(monkeypatch: pytest.MonkeyPatch) -> Terminal:
    """Standard error becomes a terminal, and bars show at once. Called in the test body: pytest's
    output capture puts its own standard error back between a fixture's set-up and the test."""
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    monkeypatch.setattr(progress_module, "DELAY", 0.0)
    return screen


def test_restore_verify_and_promote_draw_bars_on_a_terminal(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = as_terminal(monkeypatch)
    assert main(["--config", str(config_file), "restore", "step_1", "--to", str(tmp_path / "o")]) == 0
    assert "restore step_1 from memory" in terminal.getvalue()
    assert main(["--config", str(config_file), "verify", "step_1"]) == 0
    assert "verify step_1 in memory" in terminal.getvalue()
    drawn = terminal.getvalue().count("verify step_1 in memory")
    assert main(["--config", str(config_file), "verify", "--all"]) == 0
    assert terminal.getvalue().count("verify step_1 in memory") > drawn, "verify --all's own bar"
    assert Promoter(load_config(config_file)).run(once=True) == 0
    assert "promote step_1 memory->local" in terminal.getvalue()


def test_nothing_but_results_when_standard_error_is_a_pipe(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_module, "DELAY", 0.0)
    assert main(["--config", str(config_file), "restore", "step_1", "--to", str(tmp_path / "o")]) == 0
    assert main(["--config", str(config_file), "verify", "step_1"]) == 0
    assert Promoter(load_config(config_file)).run(once=True) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "%|" not in captured.out and "restored step_1 from memory" in captured.out


def test_a_restore_moves_its_bar_within_an_item_larger_than_a_chunk(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One large tensor is one item: a bar moved per item would sit still for its whole read."""
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": tier_specs("local")}))
    dcp.save({"w": torch.ones(64 * 1024)}, storage_writer=TieredWriter(str(path)), checkpoint_id="big")
    monkeypatch.setattr(export_module, "PROGRESS_CHUNK", 16 * 1024)
    steps: list[int] = []
    counted = ByteProgress.update
    monkeypatch.setattr(
        ByteProgress, "update", lambda bar, count: (steps.append(count), counted(bar, count))[1]
    )
    assert main(["--config", str(path), "restore", "big", "--to", str(tmp_path / "out")]) == 0
    assert steps.count(16 * 1024) == 16, steps  # the tensor's 256 KiB, a chunk at a time
    tensor_file = next((tmp_path / "local").rglob("*.distcp"))
    metadata = next((tmp_path / "local").rglob(".metadata"))
    assert sum(steps) == tensor_file.stat().st_size + metadata.stat().st_size
