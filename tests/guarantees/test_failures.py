"""Failed, partial, corrupt and conflicting saves: nothing uncommitted is ever loaded or listed."""

from __future__ import annotations

import copy
import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tests.training import Trainer, assert_same, fresh_target
from tests.workers import run_ranks
from tierstore import (
    Catalog,
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    InvalidCheckpointIdError,
    TieredReader,
    TieredWriter,
    latest_committed,
)
from tierstore.config import Config
from tierstore.dcp.restore.metadata import load_metadata
from tierstore.dcp.save.gate import GateView
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier, make_tier


def tier_of(config: Config, index: int = 0) -> Tier:
    return make_tier(config.tiers[index], namespace=config.namespace, node=0)


def save(config: Config, checkpoint_id: str, seed: int = 0, **writer: Any) -> dict[str, Any]:
    """Train a little, save, and return a deep copy of exactly what was saved."""
    trainer = Trainer(seed)
    trainer.train(1)
    state = trainer.state()
    expected = copy.deepcopy(state)
    dcp.save(state, storage_writer=TieredWriter(config, **writer), checkpoint_id=checkpoint_id)
    return expected


def load(config: Config, checkpoint_id: str, **reader: Any) -> tuple[dict[str, Any], TieredReader]:
    target, state = fresh_target()
    storage_reader = TieredReader(config, **reader)
    dcp.load(state, storage_reader=storage_reader, checkpoint_id=checkpoint_id)
    target.restore(state)
    return target.state(), storage_reader


class _CrashingPlanner:
    """Delegates to a planner but raises after ``after`` items were resolved: a crash mid-write."""

    def __init__(self, planner: SavePlanner, after: int) -> None:
        self._planner, self._left = planner, after

    def resolve_data(self, item: Any) -> Any:
        if self._left == 0:
            raise RuntimeError("rank crashed mid-write")
        self._left -= 1
        return self._planner.resolve_data(item)


class CrashingWriter(TieredWriter):
    """A TieredWriter whose ``write_data`` dies half-way on one rank."""

    def __init__(self, *args: Any, crash_rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crash_rank = crash_rank

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._session.rank == self.crash_rank:  # type: ignore[union-attr]
            planner = _CrashingPlanner(planner, after=3)  # type: ignore[assignment]
        return super().write_data(plan, planner)


def crash_on_rank1(rank: int, world: int, config: Config) -> None:
    trainer = Trainer(seed=1)
    trainer.train(1)
    dcp.save(trainer.state(), storage_writer=TieredWriter(config), checkpoint_id="step_000001")
    trainer.train(1)
    with pytest.raises(BaseException, match="rank crashed mid-write"):
        dcp.save(
            trainer.state(), storage_writer=CrashingWriter(config, crash_rank=1), checkpoint_id="step_000002"
        )
    assert latest_committed(config) == "step_000001"


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_save_failing_on_one_rank_leaves_no_marker(
    kind: str, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config(kind)
    run_ranks(crash_on_rank1, 2, tmp_path, config)
    tier = tier_of(config)
    assert not tier.exists(marker_path("step_000002"))
    assert latest_committed(config) == "step_000001"
    assert [entry.checkpoint_id for entry in Catalog(config).listings()] == ["step_000001"]
    with pytest.raises(BaseException, match="no tier holds a usable committed copy"):
        load(config, "step_000002")


def test_directory_without_marker_is_never_loaded(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local")
    save(config, "step_000010")
    save(config, "step_000020")
    for index in (0,):
        tier_of(config, index).delete(marker_path("step_000020"))
    assert tier_of(config).list_dir("step_000020"), "the data is still there"
    assert latest_committed(config) == "step_000010"
    with pytest.raises(BaseException) as caught:
        load(config, "step_000020")
    message = str(caught.value)
    assert "memory (memory," in message and "local (local," in message
    assert message.count("no commit marker") == 2


@pytest.mark.parametrize(
    ("damage", "verify"), [("missing", False), ("truncated", False), ("flipped", True), ("bad-marker", False)]
)
def test_damaged_copy_falls_back_to_the_next_tier(
    damage: str, verify: bool, make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config("memory", "local", verify_on_load=verify)
    trainer = save(config, "step_000005")
    Promoter(config).run_once()  # the same copy (id and generation) in the local tier too
    fast = tier_of(config, 0)
    manifest = read_manifest(fast, "step_000005", trust=MarkerTrust())
    data = next(f for f in manifest.files if f.rank == 0)
    path = Path(fast.local_path(f"step_000005/{data.path}"))
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "flipped":
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(bytes(raw))
    else:
        Path(fast.local_path(marker_path("step_000005"))).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        state, reader = load(config, "step_000005")
    assert reader.chosen_tier == "local"
    assert_same(trainer, state)
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "skipping tier memory" in warning
    if damage != "bad-marker":
        assert data.path in warning


def test_a_flipped_bit_fails_the_load_and_verification_falls_back_to_a_good_copy(
    make_config: Callable[..., Config],
) -> None:
    """Without verify_on_load the damaged copy is chosen (same size), but its flipped item is
    caught as it is read (item CRC32C): the load fails naming tier and file, never returns the
    damaged bytes. With verification the copy is skipped before choosing: local serves it."""
    config = make_config("memory", "local")
    save(config, "step_000005")
    Promoter(config).run_once()  # the same copy (id and generation) in the local tier too
    fast = tier_of(config)
    data = next(f for f in read_manifest(fast, "step_000005", trust=MarkerTrust()).files if f.rank == 0)
    path = Path(fast.local_path(f"step_000005/{data.path}"))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(BaseException, match="memory") as caught:
        load(config, "step_000005")
    assert data.path.split("/")[-1] in str(caught.value) and "CRC32C" in str(caught.value)
    assert load(config, "step_000005", verify=True)[1].chosen_tier == "local"


def test_no_usable_copy_lists_every_tier(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local")
    with pytest.raises(BaseException) as caught:
        load(config, "never_saved")
    message = str(caught.value)
    assert "never_saved" in message
    assert "memory (memory" in message and "local (local" in message
    reader = TieredReader(config, checkpoint_id="never_saved")
    with pytest.raises(CheckpointNotFoundError):
        reader.read_metadata()


def test_committed_id_is_refused_without_overwrite(make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    first = save(config, "step_000001", seed=1)
    with pytest.raises(BaseException, match="already committed in tier local") as caught:
        save(config, "step_000001", seed=2)
    assert "overwrite=True" in str(caught.value)
    assert_same(first, load(config, "step_000001")[0])


def test_overwrite_keeps_old_copy_loadable_until_the_new_one_commits(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("memory")
    old = save(config, "step_000001", seed=1)
    seen_during_overwrite: list[dict[str, Any]] = []

    def peek(view: GateView) -> None:  # runs after the new data is written, before the marker
        seen_during_overwrite.append(load(config, "step_000001")[0])

    new = save(config, "step_000001", seed=2, overwrite=True, commit_gate=peek)
    assert_same(old, seen_during_overwrite[0])
    assert_same(new, load(config, "step_000001")[0])
    generations = [n for n in tier_of(config).list_dir("step_000001") if n.startswith("g")]
    assert len(generations) == 1, "the old generation is removed after the new marker"


def test_interrupted_overwrite_leaves_the_old_copy_bit_exact(make_config: Callable[..., Config]) -> None:
    config = make_config("shared")
    old = save(config, "step_000001", seed=1)
    trainer = Trainer(seed=2)
    trainer.train(1)
    with pytest.raises(BaseException, match="rank crashed mid-write"):
        dcp.save(
            trainer.state(),
            storage_writer=CrashingWriter(config, crash_rank=0, overwrite=True),
            checkpoint_id="step_000001",
        )
    assert_same(old, load(config, "step_000001")[0])


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_concurrent_commit_of_the_same_id_keeps_exactly_one(make_config: Callable[..., Config]) -> None:
    config = make_config("s3")
    winners: list[dict[str, Any]] = []

    def race(view: GateView) -> None:  # another writer commits the id while this save runs
        winners.append(save(config, "step_000007", seed=9))

    # The other save ran in this process, which knows its commits: the refusal may come before the
    # marker (already committed) or at it (committed by another writer); never two commits.
    with pytest.raises(
        BaseException,
        match=r"CheckpointExistsError: checkpoint 'step_000007' (is"
        r" already committed in tier s3|was committed in tier s3 .* by another)",
    ):
        save(config, "step_000007", seed=8, commit_gate=race)
    assert_same(winners[0], load(config, "step_000007")[0])
    gens = {f.path.split("/")[1] for f in tier_of(config).find("step_000007") if "/g" in f.path}
    assert gens == {read_manifest(tier_of(config), "step_000007", trust=MarkerTrust()).generation}


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".", "..", ".tierstore", "x" * 300, "sp ace"])
def test_bad_checkpoint_ids_are_rejected(bad: str, make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    with pytest.raises(InvalidCheckpointIdError):
        TieredWriter(config, checkpoint_id=bad)
    with pytest.raises(InvalidCheckpointIdError):
        TieredReader(config, checkpoint_id=bad)
    trainer = Trainer(seed=0)
    with pytest.raises(InvalidCheckpointIdError):
        dcp.save(trainer.state(), storage_writer=TieredWriter(config), checkpoint_id=bad)


def test_tampered_metadata_is_refused_and_the_next_tier_used(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local")
    trainer = save(config, "step_000003")
    Promoter(config).run_once()  # the same copy (id and generation) in the local tier too
    fast = tier_of(config)
    meta = next(f for f in read_manifest(fast, "step_000003", trust=MarkerTrust()).files if f.rank is None)
    path = Path(fast.local_path(f"step_000003/{meta.path}"))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    state, reader = load(config, "step_000003")
    assert reader.chosen_tier == "local"
    assert_same(trainer, state)


def test_metadata_unpickling_refuses_code() -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            import os

            return (os.system, ("echo pwned",))

    with pytest.raises(IntegrityError, match=r"refusing to load global (posix|os)\.system"):
        load_metadata(pickle.dumps(Evil()), where="tier x: id/.metadata")


def test_marker_naming_paths_outside_the_checkpoint_is_refused(make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    save(config, "step_000001")
    tier = tier_of(config)
    marker = json.loads(tier.read_bytes(marker_path("step_000001")))
    marker["files"][0]["path"] = "../../etc/passwd"
    tier.publish(marker_path("step_000001"), json.dumps(marker).encode(), create_only=False)
    with pytest.raises(IntegrityError, match="not of the form"):
        read_manifest(tier, "step_000001", trust=MarkerTrust())
    assert latest_committed(config) is None
    with pytest.raises(CheckpointExistsError):  # a damaged marker still occupies its id
        TieredWriter(config, checkpoint_id="step_000001").set_up_storage_writer(True, rank=0)
