"""DCP's own end-of-save signal (tierstore.dcp.staging.save_events): set when the watched thread's
``dcp.save`` returns or raises, and only then."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from tierstore.dcp.staging import save_events


class Watching(DefaultSavePlanner):
    """Starts watching its own thread from inside the save (as the writer's first call does), and
    optionally fails the local plan."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.returned: threading.Event | None = None
        self.set_inside: bool | None = None

    def create_local_plan(self) -> Any:
        self.returned = save_events.watch()
        self.set_inside = self.returned.is_set()
        if self.fail:
            raise RuntimeError("the planner fails")
        return super().create_local_plan()


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_the_event_is_set_when_the_watched_save_returns_or_raises(tmp_path: Path, fail: bool) -> None:
    planner = Watching(fail)
    if fail:
        with pytest.raises(CheckpointException, match="the planner fails"):
            dcp.save({"a": torch.ones(4)}, checkpoint_id=tmp_path, planner=planner)
    else:
        dcp.save({"a": torch.ones(4)}, checkpoint_id=tmp_path, planner=planner)
    assert planner.set_inside is False, "set while the save was still running"
    assert planner.returned is not None and planner.returned.is_set()


def test_another_threads_save_does_not_set_it(tmp_path: Path) -> None:
    """A save on another thread ending says nothing about the watched one."""
    blocked, release = threading.Event(), threading.Event()
    planner = Watching()

    class Blocking(Watching):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            blocked.set()
            assert release.wait(30)
            return plan

    slow = Blocking()
    thread = threading.Thread(
        target=dcp.save,
        args=({"a": torch.ones(4)},),
        kwargs={"checkpoint_id": tmp_path / "slow", "planner": slow},
    )
    thread.start()
    try:
        assert blocked.wait(30)
        dcp.save({"a": torch.ones(4)}, checkpoint_id=tmp_path / "fast", planner=planner)
        assert slow.returned is not None and not slow.returned.is_set()
    finally:
        release.set()
        thread.join(30)
    assert slow.returned.is_set()
