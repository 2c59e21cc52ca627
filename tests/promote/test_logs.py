"""The promoter's log: without flags, one INFO line per promotion, deletion and cleanup (a
``kubectl logs -c promoter`` that says what happened); ``-q`` warnings only; ``-v`` debug detail."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tierstore import TieredWriter
from tierstore.cli import main
from tierstore.config import Config
from tierstore.promote.duties import promote
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier


@pytest.fixture
def config(make_config: Callable[..., Config]) -> Config:
    return make_config("memory", "local", tiers={"memory": {"keep": 1}}, promote={"stale_after": 60})


@pytest.fixture
def config_file(config: Config, tmp_path: Path) -> Path:
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    return path


def save(config: Config, checkpoint_id: str) -> None:
    dcp.save({"w": torch.randn(5000)}, storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def leave_an_abandoned_save(config: Config) -> None:
    """Data without a marker, older than ``stale_after``: the leftover cleanup removes it."""
    local = make_tier(config.tier("local"), namespace=config.namespace, node=0)
    local.write_bytes("step_0009/g00000000001/r00000-0.distcp", b"abandoned save")
    path = Path(local.local_path("step_0009/g00000000001/r00000-0.distcp"))
    os.utime(path, (time.time() - 3600, time.time() - 3600))


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("tierstore") and r.levelno == level]


def test_promote_logs_every_action_at_info_by_default(
    config: Config, config_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(config, "step_0001")
    save(config, "step_0002")
    leave_an_abandoned_save(config)
    memory = make_tier(config.tier("memory"), namespace=config.namespace, node=0)
    size = read_manifest(memory, "step_0001", trust=MarkerTrust()).total_bytes

    assert main(["--config", str(config_file), "promote", "--once"]) == 0

    info = lines(caplog, logging.INFO)
    promoted = [line for line in info if line.startswith("promoted checkpoint=step_0001 ")]
    assert len(promoted) == 1, info
    assert re.fullmatch(
        rf"promoted checkpoint=step_0001 source=memory target=local node=0 bytes={size}"
        r" seconds=\d+\.\d{3} verified=crc32c",
        promoted[0],
    ), promoted[0]
    assert any(line.startswith("promoted checkpoint=step_0002 ") for line in info)
    deleted = [line for line in info if line.startswith("deleted ")]  # memory keeps 1
    assert deleted == ['deleted checkpoint=step_0001 tier=memory reason="beyond keep: 1"']
    cleaned = [line for line in info if line.startswith("cleaned ")]
    assert len(cleaned) == 1 and "tier=local path=step_0009/g00000000001" in cleaned[0]
    assert lines(caplog, logging.DEBUG) == []


def test_the_promoter_says_it_started_and_stopped_even_with_nothing_to_do(
    config_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An empty log cannot tell a promoter with no work from one that never ran."""
    assert main(["--config", str(config_file), "promote", "--once"]) == 0
    info = lines(caplog, logging.INFO)
    assert info == [
        "promoter_started node=0 tiers=memory,local interval=10.000 once=True",
        "promoter_stopped node=0 status=0",
    ], info


def test_quiet_leaves_only_warnings(
    config: Config, config_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(config, "step_0001")
    assert main(["--config", str(config_file), "promote", "--once", "-q"]) == 0
    assert lines(caplog, logging.INFO) == []
    assert read_manifest(
        make_tier(config.tier("local"), namespace=config.namespace, node=0), "step_0001", trust=MarkerTrust()
    )


def test_verbose_adds_debug_detail(
    config: Config, config_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(config, "step_0001")
    assert main(["-v", "--config", str(config_file), "promote", "--once"]) == 0
    debug = lines(caplog, logging.DEBUG)
    assert any(
        re.fullmatch(r"promoting step_0001 \(generation \S+\) from memory to local", line) for line in debug
    ), debug
    assert any(line.startswith("pass: 1 promoted, 0 failed") for line in debug), debug
    assert any(line.startswith("promoted checkpoint=step_0001 ") for line in lines(caplog, logging.INFO))


def test_other_commands_stay_quiet_and_main_puts_the_levels_back(
    config: Config, config_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(config, "step_0001")
    before = logging.getLogger("tierstore").level
    assert main(["--config", str(config_file), "gc"]) == 0  # prints its actions instead
    assert lines(caplog, logging.INFO) == []
    assert logging.getLogger("tierstore").level == before


def test_a_promotion_the_target_already_holds_says_so(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    save(config, "step_0001")
    promoter = Promoter(config)
    view = promoter.look()
    planned = promote.plan(view, promoter.context.rules)  # the plan made before another promoter won
    Promoter(config).run_once()  # another promoter commits it first
    with caplog.at_level(logging.INFO, logger="tierstore"):
        promote.run(planned[0], view, promoter.context)
    info = lines(caplog, logging.INFO)
    assert info == [
        "promotion_skipped checkpoint=step_0001 source=memory target=local"
        ' reason="the target already holds this commit"'
    ], info


def test_a_corrupt_source_is_logged_once_not_on_every_pass(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """A source that fails verification fails every pass the same way: one ERROR line says so;
    the retries are DEBUG, and a different failure of it is an ERROR again."""
    save(config, "step_0001")
    memory = make_tier(config.tier("memory"), namespace=config.namespace, node=0)
    manifest = read_manifest(memory, "step_0001", trust=MarkerTrust())
    data = next(f.path for f in manifest.files if f.path.endswith(".distcp"))
    with open(memory.local_path(f"step_0001/{data}"), "r+b") as handle:
        handle.seek(64)
        byte = handle.read(1)
        handle.seek(64)
        handle.write(bytes([byte[0] ^ 0x01]))
    caplog.set_level(logging.DEBUG, logger="tierstore.promote.sidecar")
    promoter = Promoter(config)
    for _ in range(3):
        assert promoter.run(once=True) == 1

    def failed(level: int) -> list[str]:
        return [line for line in lines(caplog, level) if "step_0001" in line and "fail" in line]

    assert len(failed(logging.ERROR)) == 1, failed(logging.ERROR)
    assert failed(logging.ERROR)[0].startswith("promotion_failed checkpoint=step_0001 source=memory")
    assert failed(logging.INFO) == [], "not twice (INFO and ERROR)"
    assert len(failed(logging.DEBUG)) == 2, "each later pass's failure is detail"
