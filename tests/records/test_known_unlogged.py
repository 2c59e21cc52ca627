"""A promotion's marker whose log entry never became durable still raises the commit numbers.

Found by the power-loss sweep (tests/guarantees/test_power_loss.py, seed 0): a promotion publishes
the target's marker, then logs its number there. A power cut between the two, on a node whose first
tier is host memory, leaves the disk tier's marker without its log entry and the memory tier
empty. The next process's first save took its number from the logs alone, the promoted marker's
number again, and the promoted checkpoint stayed the newest: the fresh save was not restored.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter, latest_committed
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.records.log import read_log
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust


def _config(root: Path) -> Config:
    return config_from_dict(
        {
            "namespace": "run",
            "tiers": [
                {"name": "memory", "type": "memory", "path": f"{root}/memory/{{node}}"},
                {"name": "local", "type": "local", "path": f"{root}/local/{{node}}"},
            ],
        }
    )


def _save(config: Config, checkpoint_id: str, value: float) -> None:
    state = {"w": torch.full((4,), value)}
    dcp.save(copy.deepcopy(state), storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def test_a_save_after_a_cut_between_a_promotions_marker_and_log_entry_is_the_newest(tmp_path: Path) -> None:
    before = tmp_path / "before"
    config = _config(before)
    _save(config, "step_1", 1.0)
    assert Promoter(config).run(once=True) == 0
    local = config.make_tiers(node=0)[1]
    promoted = read_manifest(local, "step_1", trust=MarkerTrust())
    for entry in read_log(local):  # the power cut: the log entry was not durable yet
        local.delete(entry.path)
    # ... and host memory is empty; a new process (a new root: no start-up look made yet) restarts
    after = tmp_path / "after"
    shutil.copytree(before / "local", after / "local")
    restarted = _config(after)
    _save(restarted, "step_2", 2.0)
    fresh = read_manifest(restarted.make_tiers(node=0)[0], "step_2", trust=MarkerTrust())
    assert (fresh.seq or 0) > (promoted.seq or 0), (fresh.seq, promoted.seq)
    assert latest_committed(restarted, collective=False) == "step_2"
