"""The test lanes: which tests the scan sends out of the quick lane, and the guard behind it."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from tests.lanes import LaneError, _Scan
from tests.workers import run_ranks


def _starts_ranks(tmp: Path) -> None:
    run_ranks(print, 2, tmp)


def _through_a_helper(tmp: Path) -> None:
    _starts_ranks(tmp)


def _forks() -> int:
    return os.fork()


def _only_computes(value: int) -> int:
    return value * 2


class _Launcher:
    def launch(self, tmp: Path) -> None:
        _through_a_helper(tmp)


def test_the_scan_follows_helpers_and_methods_to_what_starts_processes() -> None:
    scan = _Scan()
    # Looked up by name: a reference in this test's own code would send it to the procs lane.
    here = globals()
    assert scan.reason(here["_starts_ranks"]) is not None
    assert scan.reason(here["_through_a_helper"]) is not None  # two calls away
    assert scan.reason(here["_Launcher"]) is not None  # a class whose method reaches it
    assert scan.reason(here["_forks"]) is not None  # os.fork, reached as a module attribute
    assert scan.reason(here["_only_computes"]) is None
    multi_rank = importlib.import_module("tests.guarantees.test_multirank")
    assert scan.reason(multi_rank.test_world2_save_then_load_at_world_1_and_2) is not None


def test_this_module_stays_in_the_quick_lane(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("procs") is None


def test_the_guard_fails_a_quick_test_that_starts_a_process_anyway() -> None:
    hidden = importlib.import_module("subprocess")  # out of the scan's sight, on purpose
    with pytest.raises(LaneError, match="starts a process"):
        hidden.run(["true"], check=False)
