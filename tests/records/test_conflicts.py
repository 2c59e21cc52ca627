"""Two contents under one id: the promoter keeps both, says so, and lets an operator settle it.

A job that starts while the durable tier is unreachable cannot know the ids committed there; a save
of such an id commits in its own tier (tiers stand alone) with the tier it could not see in its marker.
The promoter must never let it replace the durable copy, nor be replaced by it: both stay, a conflict
record holds the copy above against retention, and ``tierstore drop`` on one of them settles it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.tiers.dict_tier import FAULTS
from tierstore import TieredReader, TieredWriter
from tierstore.cli import main
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.records import known
from tierstore.records.conflicts import read_conflicts
from tierstore.records.marker import Manifest, read_manifest
from tierstore.records.protocol import Verdict, judge_promotion
from tierstore.signing import MarkerTrust


@pytest.fixture
def config() -> Iterator[Config]:
    run = uuid.uuid4().hex[:8]
    yield config_from_dict(
        {
            "tiers": [
                {"name": "fast", "type": "dict", "store": f"fast-{run}", "keep": 1},
                {"name": "durable", "type": "dict", "store": f"durable-{run}"},
            ],
            "probe_timeout": "2s",
        }
    )
    FAULTS.down.clear()


def _save(config: Config, checkpoint_id: str, value: float, **writer: Any) -> None:
    state = {"w": torch.full((16,), value)}
    dcp.save(state, storage_writer=TieredWriter(config, **writer), checkpoint_id=checkpoint_id)


def _value(config: Config, checkpoint_id: str) -> float:
    state = {"w": torch.zeros(16)}
    dcp.load(state, storage_reader=TieredReader(config), checkpoint_id=checkpoint_id)
    return float(state["w"][0])


def _restart() -> None:
    """A new process: nothing learnt at start-up, and no commits of its own."""
    known._KNOWN.get().clear()


def _store(config: Config, name: str) -> str:
    return str(next(t for t in config.tiers if t.name == name).store)  # type: ignore[attr-defined]


def test_a_save_blind_to_the_durable_tier_is_kept_beside_its_copy_there(
    config: Config, tmp_path: Path
) -> None:
    fast, durable = config.make_tiers(node=0)
    _save(config, "x", 1.0, tier="durable")  # an earlier job's checkpoint, durable only
    _restart()
    FAULTS.down.add(_store(config, "durable"))  # the next job starts while S3 is away
    _save(config, "x", 2.0)  # it cannot know of x: the save commits in its own tier
    assert read_manifest(fast, "x", trust=MarkerTrust()).unseen_tiers == ("durable",)
    FAULTS.down.clear()  # the tier is back

    promoter = Promoter(config)
    promoter.run_once()
    assert _generation(durable, "x") != _generation(fast, "x"), "both contents are kept"
    (conflict,) = read_conflicts(fast)
    assert (conflict.checkpoint_id, conflict.target) == ("x", "durable")
    assert "could not see tier durable" in conflict.why
    metric = promoter.metrics.registry.get_sample_value("tierstore_conflicts", {"tier": "fast"})
    assert metric == 1
    _save(config, "y", 3.0)  # keep: 1 in fast would drop x: the conflict keeps it
    promoter.run_once()
    assert fast.exists("x/commit.json") and durable.exists("x/commit.json")
    assert read_manifest(durable, "x", trust=MarkerTrust()).generation == conflict.target_generation

    # Settled by hand: the durable copy goes, the next passes promote the one above.
    kept = read_manifest(fast, "x", trust=MarkerTrust()).generation
    assert main(["--config", _yaml(config, tmp_path), "drop", "x", "--tier", "durable"]) == 0
    promoter.run_once()
    promoter.run_once()
    assert read_conflicts(fast) == []
    assert read_manifest(durable, "x", trust=MarkerTrust()).generation == kept
    _restart()
    assert _value(config, "x") == 2.0


def test_a_durable_save_blind_to_the_fast_tier_does_not_replace_its_copy(config: Config) -> None:
    """The other way round: a job saving straight into the durable tier could not see the fast
    tier, which held the id; the fast copy is not promoted over it, nor dropped as stale."""
    fast, durable = config.make_tiers(node=0)
    _save(config, "x", 1.0)
    _restart()
    FAULTS.down.add(_store(config, "fast"))
    _save(config, "x", 2.0, tier="durable")  # blind to fast, where x is committed
    FAULTS.down.clear()
    _restart()
    Promoter(config).run_once()
    assert _generation(fast, "x") != _generation(durable, "x"), "both contents are kept"
    (conflict,) = read_conflicts(fast)
    assert "saved without knowing of the one in fast" in conflict.why


def _generation(tier: Any, checkpoint_id: str) -> str:
    return read_manifest(tier, checkpoint_id, trust=MarkerTrust()).generation


def _yaml(config: Config, folder: Path) -> str:
    path = folder / "tierstore.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"})), encoding="utf-8")
    return str(path)


def _manifest(generation: str, seq: int, *, overwrite: bool | None, unseen: tuple[str, ...] = ()) -> Manifest:
    return Manifest("x", generation, 1, (), seq=seq, overwrite=overwrite, unseen_tiers=unseen)


@pytest.mark.parametrize(
    ("source", "existing", "verdict"),
    [
        (
            _manifest("g0000000001", 5, overwrite=False),
            _manifest("g0000000001", 5, overwrite=False),
            Verdict.SAME,
        ),
        (
            _manifest("g0000000002", 7, overwrite=True),
            _manifest("g0000000001", 5, overwrite=False),
            Verdict.REPLACE,
        ),  # an overwrite that saw the target: the newer commit replaces
        (
            _manifest("g0000000001", 5, overwrite=False),
            _manifest("g0000000002", 7, overwrite=True),
            Verdict.KEEP_NEWER,
        ),  # the target's copy is an overwrite of this one: this one is stale
        (
            _manifest("g0000000002", 7, overwrite=False),
            _manifest("g0000000001", 5, overwrite=False),
            Verdict.CONFLICT,
        ),  # saved without overwrite while the target held the id: a race
        (
            _manifest("g0000000002", 7, overwrite=True, unseen=("durable",)),
            _manifest("g0000000001", 5, overwrite=False),
            Verdict.CONFLICT,
        ),  # blind to the target
        (
            _manifest("g0000000001", 5, overwrite=False, unseen=("durable",)),
            _manifest("g0000000002", 50, overwrite=False),
            Verdict.CONFLICT,
        ),  # never replaced either
        (
            _manifest("g0000000002", 7, overwrite=None),
            _manifest("g0000000001", 5, overwrite=None),
            Verdict.REPLACE,
        ),  # markers from before overwrite was recorded: commit order, as before
    ],
)
def test_which_content_a_promotion_keeps(source: Manifest, existing: Manifest, verdict: Verdict) -> None:
    assert judge_promotion(source, existing, source_tier="fast", target="durable")[0] is verdict
