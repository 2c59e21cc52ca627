"""A trainer for the clock-skew tests, run as ``python -m tests.guarantees.skewed_trainer CONFIG
ACTION...`` under ``faketime``, one process for all its actions (what it knows of the other tiers
is kept between them). Each action is ``KIND:ID:VALUE[:TIER]``: ``save``, ``overwrite``, ``pause``
(a save held after its files are durable, before its marker, until the test creates ``go`` beside
the YAML; it creates ``reached`` when it gets there) or ``refused`` (the save must be refused: the
id is committed in some tier).

Its waits poll with ``time.sleep`` and measure with ``time.time``: under libfaketime 0.9.10 a timed
wait on a lock or event (``Event.wait(5)``) never times out, because Python waits on the monotonic
clock that faketime moves by years; ``time.sleep`` and the wall clock's pace are right.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from tests.guarantees.test_concurrency import state_of
from tierstore import TieredWriter, load_config
from tierstore.dcp.save.gate import GateView

WAIT_S = 120.0


class FileGate:
    """A commit gate that holds its save until the test creates ``go``."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def __call__(self, _view: GateView) -> str | None:
        (self.where / "reached").touch()
        began = time.time()
        while not (self.where / "go").exists():
            if time.time() - began > WAIT_S:
                raise TimeoutError("the test never released the paused save")
            time.sleep(0.05)
        return None


def main(argv: list[str]) -> int:
    config_path = Path(argv[0])
    config = load_config(config_path)
    for action in argv[1:]:
        kind, checkpoint_id, value, *tier = action.split(":")
        writer = TieredWriter(
            config,
            tier=tier[0] if tier else None,
            overwrite=kind == "overwrite",
            commit_gate=FileGate(config_path.parent) if kind == "pause" else None,
        )
        try:
            dcp.save(state_of(float(value)), storage_writer=writer, checkpoint_id=checkpoint_id)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if kind == "refused" and "already committed" in str(exc):
                continue
            raise
        if kind == "refused":
            print(f"{action}: the save of an id committed elsewhere was not refused")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
