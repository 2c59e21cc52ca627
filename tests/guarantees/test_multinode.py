"""Two simulated nodes (one tier root each), two ranks, two promoter processes, one S3 target."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.records.marker import copy_problems, read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier


def tensors(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {f"layer{i}": torch.randn(50_000, generator=generator) for i in range(4)}


def save_on_two_nodes(rank: int, world: int, config: Config, step: int) -> None:
    # Each rank owns two of the four tensors (as with a sharded model); rank r runs on node r.
    mine = {k: v for i, (k, v) in enumerate(tensors(step).items()) if i % world == rank}
    state = {"model": mine, "step": step}
    writer = TieredWriter(config, node=rank)
    dcp.save(state, storage_writer=writer, checkpoint_id=f"step_{step:04d}")
    dist.barrier()


def promote(path: Path, node: int) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "--config",
            str(path),
            "--node",
            str(node),
            "-v",
            "promote",
            "--once",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_two_nodes_promote_their_parts_and_commit_once(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", "s3", tiers={"memory": {"keep": 1}})
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    ram0, ram1 = (make_tier(config.tiers[0], namespace=None, node=n) for n in (0, 1))
    s3 = make_tier(config.tier("s3"), namespace=None, node=0)

    run_ranks(save_on_two_nodes, 2, tmp_path, config, 1)
    assert ram0.exists(marker_path("step_0001")) and not ram1.exists(marker_path("step_0001"))
    assert any("r00001" in f.path for f in ram1.find("step_0001")), "rank 1's data is on node 1"
    assert any(f.path.endswith("parts/rank00001.json") for f in ram1.find("step_0001")), (
        "a rank on a node without the marker leaves a part record after its data"
    )

    log1 = promote(path, node=1)  # node 1 first: its part arrives, no marker yet
    assert "part_copied checkpoint=step_0001" in log1
    assert not s3.exists(marker_path("step_0001"))
    log0 = promote(path, node=0)  # node 0 sees every part: it commits
    assert "promoted checkpoint=step_0001" in log0
    manifest = read_manifest(s3, "step_0001", trust=MarkerTrust())
    assert manifest.nodes == [0, 1] and copy_problems(s3, manifest, verify=True) == []

    run_ranks(save_on_two_nodes, 2, tmp_path, config, 2)
    log0 = promote(path, node=0)  # now node 0 first: it leaves the manifest and waits
    assert "part_copied checkpoint=step_0002" in log0 and not s3.exists(marker_path("step_0002"))
    log1 = promote(path, node=1)  # node 1 completes the set and commits
    assert "promoted checkpoint=step_0002" in log1
    assert copy_problems(s3, read_manifest(s3, "step_0002", trust=MarkerTrust()), verify=True) == []

    # retention (ram keep: 1) removed step 1 from both nodes once it was safe in S3
    promote(path, node=0)
    promote(path, node=1)
    for ram in (ram0, ram1):  # .tierstore: tierstore's own working area (activity records)
        assert [name for name in ram.list_dir("") if name != ".tierstore"] == ["step_0002"]

    state = {"model": {k: torch.zeros_like(v) for k, v in tensors(2).items()}, "step": 0}
    reader = TieredReader(config)
    dcp.load(state, storage_reader=reader, checkpoint_id="step_0002")
    assert reader.chosen_tier == "s3", "node-local copies span two nodes: S3 serves a one-node restore"
    for key, value in tensors(2).items():
        assert torch.equal(state["model"][key], value)
    assert state["step"] == 2


def veto_on_rank_1(view: Any) -> str | None:
    """A commit gate that refuses on rank 1 only (as a loss spike seen by one rank would)."""
    return "loss spike" if view.rank == 1 else None


def vetoed_save_on_two_nodes(rank: int, world: int, config: Config) -> None:
    mine = {k: v for i, (k, v) in enumerate(tensors(9).items()) if i % world == rank}
    writer = TieredWriter(config, node=rank, commit_gate=veto_on_rank_1)
    with pytest.raises(BaseException, match="loss spike"):
        dcp.save({"model": mine}, storage_writer=writer, checkpoint_id="step_0009")
    del writer  # the save is over: its activity record goes with it
    dist.barrier()


def test_a_vetoed_multi_node_save_leaves_nothing_in_host_memory(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", promote={"stale_after": 0})
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    run_ranks(vetoed_save_on_two_nodes, 2, tmp_path, config)
    ram0 = make_tier(config.tiers[0], namespace=None, node=0)
    assert any("r00000" in f.path for f in ram0.find("step_0009")), "rank 0 wrote its share"
    assert not ram0.exists(marker_path("step_0009"))
    subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--config", str(path), "--node", "0", "gc"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert ram0.find("step_0009") == [], "the coordinator's node must not keep a failed save"


def restart_on_two_nodes(rank: int, world: int, config: Config) -> None:
    latest = latest_committed(config, node=rank)
    assert latest == "step_0001", "step 2 is only in two nodes' memory: this job cannot restore it"
    state = {"model": {k: torch.zeros_like(v) for k, v in tensors(1).items()}, "step": 0}
    dcp.load(state, storage_reader=TieredReader(config, node=rank), checkpoint_id=latest)
    assert all(torch.equal(state["model"][k], v) for k, v in tensors(1).items())


def test_latest_is_the_newest_checkpoint_this_job_can_restore(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", "s3")
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    run_ranks(save_on_two_nodes, 2, tmp_path, config, 1)
    promote(path, node=1)
    promote(path, node=0)  # step 1 is complete in S3
    run_ranks(save_on_two_nodes, 2, tmp_path, config, 2)  # step 2: host memory of both nodes only
    run_ranks(restart_on_two_nodes, 2, tmp_path, config)
    assert latest_committed(config, node=0) == "step_0001", "nor can a one-process job on node 0"


class HoldRank:
    """A commit gate that holds one rank until a file appears (a straggler, paused for real)."""

    def __init__(self, rank: int, release: str, reached: str) -> None:
        self.rank, self.release, self.reached = rank, release, reached

    def __call__(self, view: Any) -> str | None:
        if view.rank == self.rank:
            Path(self.reached).touch()
            deadline = time.monotonic() + 120
            while not Path(self.release).exists():
                assert time.monotonic() < deadline, "never released"
                time.sleep(0.05)
        return None


def save_two_ranks_per_node(rank: int, world: int, config: Config, gate: HoldRank) -> None:
    node = rank // 2  # ranks 0, 1 on node 0; ranks 2, 3 on node 1
    mine = {k: v for i, (k, v) in enumerate(tensors(4).items()) if i % world == rank}
    writer = TieredWriter(config, node=node, commit_gate=gate)
    dcp.save({"model": mine}, storage_writer=writer, checkpoint_id="step_0004")


def test_a_node_part_is_promoted_only_once_every_rank_of_the_node_wrote(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", "s3")
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    gate = HoldRank(3, str(tmp_path / "release"), str(tmp_path / "reached"))
    saving = threading.Thread(target=run_ranks, args=(save_two_ranks_per_node, 4, tmp_path, config, gate))
    saving.start()
    try:
        deadline = time.monotonic() + 120
        while not Path(gate.reached).exists():
            assert time.monotonic() < deadline, "rank 3 never reached its gate"
            time.sleep(0.05)
        promote(path, node=1)  # rank 2 is done, rank 3 (same node) is still writing
    finally:
        Path(gate.release).touch()
        saving.join()
    promote(path, node=1)
    promote(path, node=0)
    s3 = make_tier(config.tier("s3"), namespace=None, node=0)
    manifest = read_manifest(s3, "step_0004", trust=MarkerTrust())
    assert sorted({f.rank for f in manifest.files if f.rank is not None}) == [0, 1, 2, 3]
    assert copy_problems(s3, manifest, verify=True) == []
