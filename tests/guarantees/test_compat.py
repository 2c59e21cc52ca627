"""Checkpoints written by tierstore 0.1.0 (the release before the package was reorganised) still load.

``tests/fixtures/checkpoints_v0_1_0`` was written by ``tests/fixtures/make_checkpoints_v0_1_0.py`` with
that release: a plain ``dcp.save`` and a staged ``dcp.async_save``. Their ``.metadata`` pickles the item
locations under the old module path (``tierstore.dcp.layout.ItemLocation``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.fixtures.make_checkpoints_v0_1_0 import state
from tierstore import TieredReader, latest_committed
from tierstore.config import config_from_dict

FIXTURE = Path(__file__).parent.parent / "fixtures" / "checkpoints_v0_1_0"


@pytest.mark.parametrize("step", [3, 5])
def test_a_checkpoint_written_by_release_0_1_0_loads_bit_exact(tmp_path: Path, step: int) -> None:
    root = tmp_path / "disk"
    shutil.copytree(FIXTURE, root)
    assert b"tierstore.serialize" in next(root.glob(f"step_{step:06d}/*/.metadata")).read_bytes()
    config = config_from_dict({"tiers": [{"name": "disk", "type": "local", "path": str(root)}]})
    assert latest_committed(config) == "step_000005"
    expected = state(step)
    target = {
        "model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
        "step": 0,
        "lr": 0.0,
        "extra": b"",
        "nested": {"names": ["?", "?"]},
    }
    dcp.load(target, storage_reader=TieredReader(config, verify=True), checkpoint_id=f"step_{step:06d}")
    for key, tensor in expected["model"].items():
        assert torch.equal(target["model"][key], tensor), key
    assert {k: target[k] for k in ("step", "lr", "extra", "nested")} == {
        k: expected[k] for k in ("step", "lr", "extra", "nested")
    }
