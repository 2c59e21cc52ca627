"""A tier root may hold foreign files (notes, the config, a probe file): nothing chokes on them.

Issue 22, row 5: a stray regular file in a node-local tier root made every promoter pass and every
``tierstore gc`` fail with ``Not a directory: …/notes.txt/commit.json``: nothing was promoted, retention
never ran, host memory filled. The promoter, gc and ``ls`` now ignore such files, with one warning per
file per run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.promote.sidecar import Promoter
from tierstore.records.catalog import Catalog


def _save(config: Config, checkpoint_id: str) -> None:
    dcp.save({"w": torch.ones(8)}, storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def test_a_stray_file_in_a_tier_root_is_ignored_with_a_warning(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config("memory", "local", tiers={"memory": {"keep": 1}})
    memory, local = config.make_tiers(node=0)
    for tier in (memory, local):
        for name in ("notes.txt", "tierstore.yaml", ".tierstore-probe-1234"):
            (Path(tier.root) / name).write_text("not a checkpoint")
    _save(config, "step_1")
    _save(config, "step_2")
    with caplog.at_level(logging.WARNING):
        report = Promoter(config).run_once()
    assert report.failed == []
    assert local.exists("step_2/commit.json"), "promotion went on"
    assert not memory.exists("step_1/commit.json"), "retention went on"
    said = [r.getMessage() for r in caplog.records if "notes.txt in its root" in r.getMessage()]
    assert len(said) == 2, f"one warning per file, tier and run: {said}"
    again = Promoter(config)  # a second run says it again, once per file and tier
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again.run_once()
        again.run_once()
    assert sum("notes.txt in its root" in r.getMessage() for r in caplog.records) == 2
    assert [e.checkpoint_id for e in Catalog(config).listings()] == ["step_2", "step_1"]
    assert latest_committed(config, collective=False) == "step_2"
    assert (Path(memory.root) / "notes.txt").read_text() == "not a checkpoint", "left alone"
