"""The trainer side says what a restart decided: which checkpoint, from which tier, how long it took;
or that nothing is restorable (a fresh start); and which tiers it could not reach."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config, config_from_dict


def info(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("tierstore.dcp") and r.levelno == logging.INFO
    ]


def test_a_fresh_start_is_logged_naming_the_tiers_looked_in(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config("memory", "local")
    with caplog.at_level(logging.INFO, logger="tierstore"):
        assert latest_committed(config) is None
    assert len(info(caplog)) == 1, info(caplog)
    assert re.fullmatch(
        r"no committed checkpoint this job can restore in tiers memory, local"
        r" \(looked in \d+\.\d\d s\)",
        info(caplog)[0],
    ), info(caplog)


def test_the_checkpoint_and_tier_a_restart_takes_are_logged(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config("memory", "local")
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="step_0007")
    with caplog.at_level(logging.INFO, logger="tierstore"):
        checkpoint = latest_committed(config)
        assert checkpoint == "step_0007"
        target = {"w": torch.zeros(1000)}
        dcp.load(target, storage_reader=TieredReader(config), checkpoint_id=checkpoint)
    assert torch.equal(target["w"], state["w"])
    said = info(caplog)
    assert re.fullmatch(
        r"latest committed checkpoint: step_0007, restorable from tier memory"
        r" \(found in \d+\.\d\d s\)",
        said[0],
    ), said
    assert said[1].startswith("restore of step_0007: from tier memory (commit 1, generation ")
    assert re.fullmatch(
        r"restored step_0007 from tier memory: rank 0 read \d+ bytes, \d+\.\d\d s"
        r" since the load began",
        said[2],
    ), said
    read = int(said[2].split(" read ")[1].split()[0])
    assert read >= 4000  # the tensor's bytes at least, and .metadata


def test_an_unreachable_tier_is_named_with_the_decision(
    tier_specs: Callable[..., list[dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    dead = {
        "name": "s3",
        "type": "s3",
        "url": "s3://bucket/x",
        "max_attempts": 1,
        "endpoint_url": "http://127.0.0.1:9",
    }
    config = config_from_dict({"tiers": [*tier_specs("memory"), dead], "probe_timeout": 5})
    with caplog.at_level(logging.INFO, logger="tierstore"):
        assert latest_committed(config) is None
    said = info(caplog)
    assert len(said) == 1 and said[0].startswith(
        "no committed checkpoint this job can restore in tiers memory, s3"
    )
    assert "; not reachable, not searched: s3 (" in said[0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("tier s3 is unreachable" in line for line in warned), warned
