"""A multi-node save's part on a node other than the coordinator's: who protects it, who may drop it.

Two simulated nodes (one memory root each, ``{node}``), one gloo rank per node. The coordinator's
record lives in its own node's tier; the other node's cleanup never sees it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.guarantees.test_multinode import HoldRank
from tests.mirror_jobs import (
    become,
    check_latest,
    load_step,
    memory_root,
    mirror_config,
    save_plan,
    shard_state,
)
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config
from tierstore.promote.cleanup import find_leftovers, remove
from tierstore.promote.discovery import foreign_parts
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import copy_problems, read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier


def state_of(rank: int) -> dict[str, torch.Tensor]:
    return {f"w{rank}": torch.arange(40_000, dtype=torch.float32) + rank}


def save_with_gate(rank: int, world: int, config: Config, gate: HoldRank) -> None:
    writer = TieredWriter(config, node=rank, commit_gate=gate)
    dcp.save({"model": state_of(rank)}, storage_writer=writer, checkpoint_id="step_0001")


def wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not Path(path).exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_stragglers_part_survives_its_nodes_gc_and_the_marker_never_covers_a_hole(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Row 4: rank 1 (node 1) has written its data and stalls before its part record; node 1's gc
    runs with a short ``stale_after``. The part must stay: the save commits over complete data."""
    config = make_config("memory", "shared", promote={"stale_after": "1s"})
    gate = HoldRank(1, str(tmp_path / "release"), str(tmp_path / "reached"))
    saving = threading.Thread(target=run_ranks, args=(save_with_gate, 2, tmp_path, config, gate))
    saving.start()
    ram1 = make_tier(config.tiers[0], namespace=None, node=1)
    try:
        wait_for(gate.reached)
        time.sleep(1.5)  # older than stale_after: only a record can say it is in flight
        for leftover in find_leftovers(ram1, stale_after=1.0, activity_ttl=60.0, trust=MarkerTrust()):
            remove(ram1, leftover, trust=MarkerTrust())
    finally:
        Path(gate.release).touch()
        saving.join()
    ram0 = make_tier(config.tiers[0], namespace=None, node=0)
    manifest = read_manifest(ram0, "step_0001", trust=MarkerTrust())
    node1 = [f for f in manifest.files if f.node == 1]
    assert node1, "the save spans both nodes"
    assert copy_problems(ram1, manifest, verify=True, entries=node1) == []


SMALL = 20_000


class CrashWhenPartWritten:
    """Rank 0's commit gate: once node 1's part record of this save is durable (the second one of
    the id there), the whole job dies (SIGKILL to rank 1, then rank 0 exits): the coordinator
    crashed before its marker."""

    def __init__(self, parts_glob: str, pids: str) -> None:
        self.parts_glob, self.pids = parts_glob, pids

    def __call__(self, view: Any) -> str | None:
        if view.rank != 0:
            return None
        deadline = time.monotonic() + 60
        while len(list(Path("/").glob(self.parts_glob.lstrip("/")))) < 2:
            assert time.monotonic() < deadline, "node 1 never wrote its part"
            time.sleep(0.02)
        os.kill(int(Path(self.pids, "1").read_text()), signal.SIGKILL)
        os._exit(9)


def save_then_crash_an_overwrite(rank: int, world: int, config: Config, gate: CrashWhenPartWritten) -> None:
    """``latest`` saved and mirrored; an overwrite of it that crashes on the coordinator."""
    become(rank)
    Path(gate.pids, str(rank)).write_text(str(os.getpid()))
    writer = TieredWriter(config, node=rank)
    dcp.save(shard_state(rank, 1, SMALL), storage_writer=writer, checkpoint_id="latest")
    assert writer.wait_mirrored(60)
    overwrite = TieredWriter(config, node=rank, overwrite=True, commit_gate=gate)
    dcp.save(shard_state(rank, 2, SMALL), storage_writer=overwrite, checkpoint_id="latest")
    raise AssertionError("the overwrite was to crash")


def test_a_crashed_overwrites_parts_on_another_node_do_not_hide_the_committed_checkpoint(
    tmp_path: Path,
) -> None:
    """Row 1: the coordinator's node is alive and its marker names the first save: node 1's part of
    the crashed overwrite is no evidence of a newer commit. The restart resumes from ``latest``
    (the first save's contents) from memory."""
    config = mirror_config(tmp_path, lower=("shared",), keep=2)
    pids = tmp_path / "pids"
    pids.mkdir()
    gate = CrashWhenPartWritten(str(memory_root(tmp_path, 1) / "latest/*/parts/rank*.json"), str(pids))
    try:
        run_ranks(save_then_crash_an_overwrite, 2, tmp_path, config, gate)
    except Exception as exc:  # noqa: BLE001 - the job was killed on purpose
        assert "exit" in str(exc).lower() or "signal" in str(exc).lower(), exc
    else:
        raise AssertionError("the job was to crash")
    generations = sorted(p.name for p in memory_root(tmp_path, 1).glob("latest/g*"))
    assert len(generations) == 2, f"node 1 holds its parts of both saves: {generations}"
    run_ranks(check_latest, 2, tmp_path, config, (0, 1), "latest")
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "latest", ("memory", 1), SMALL)


def test_a_mirror_is_stale_when_another_node_local_tier_holds_a_newer_save_of_the_id(tmp_path: Path) -> None:
    """Row 3: ``X`` saved and mirrored, then overwritten with ``tier="local"``; node 0 is replaced
    (its memory and local disk empty). Node 1's mirror of node 0's first save is stale: the parts
    of the overwrite on node 1's local disk say so, so it is never served."""
    config = mirror_config(tmp_path, lower=("local", "shared"), keep=2)
    plan = [("X", 1, SMALL, {}), ("X", 2, SMALL, {"overwrite": True, "tier": "local"})]
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), plan)
    shutil.rmtree(memory_root(tmp_path, 0))
    shutil.rmtree(tmp_path / "local" / "0")
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "X", None, SMALL)


def overwrite_latest(rank: int, world: int, config: Config, step: int) -> None:
    writer = TieredWriter(config, node=rank, overwrite=True)
    dcp.save({"model": state_of(rank + step)}, storage_writer=writer, checkpoint_id="latest")


def test_a_node_other_than_the_coordinators_drops_its_parts_of_replaced_generations(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Row 6: ``latest`` overwritten again and again, promoters on both nodes: node 1 keeps its
    part of the newest generation only, not every replaced one."""
    config = make_config("memory", "shared", tiers={"memory": {"keep": 2}})
    promoters = [Promoter(config, node=n) for n in (0, 1)]
    for step in range(1, 5):
        run_ranks(overwrite_latest, 2, tmp_path, config, step)
        for promoter in (promoters[1], promoters[0]):  # node 1's part first: node 0 commits
            promoter.run_once()
    promoters[1].run_once()
    shared = make_tier(config.tier("shared"), namespace=None, node=0)
    newest = read_manifest(shared, "latest", trust=MarkerTrust()).generation
    ram1 = make_tier(config.tiers[0], namespace=None, node=1)
    assert ram1.list_dir("latest") == [newest]
    assert sorted(foreign_parts(ram1)["latest"]) == [newest]


def overwrite_latest_held(rank: int, world: int, config: Config, gate: HoldRank) -> None:
    writer = TieredWriter(config, node=rank, overwrite=True, commit_gate=gate)
    dcp.save({"model": state_of(rank + 100)}, storage_writer=writer, checkpoint_id="latest")


def test_a_multi_node_save_that_commits_last_is_the_newest_everywhere(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Row 2: save A of ``latest`` is planned (its number claimed), then held at rank 0's gate;
    save B of ``latest`` commits and is promoted; A commits last. A is the newest commit of the id:
    its marker ranks above B's, and the promoters replace B with A in the shared tier."""
    config = make_config("memory", "shared")
    gate = HoldRank(0, str(tmp_path / "release"), str(tmp_path / "reached"))
    a = threading.Thread(target=run_ranks, args=(overwrite_latest_held, 2, tmp_path / "a", config, gate))
    (tmp_path / "a").mkdir()
    a.start()
    try:
        wait_for(gate.reached)
        run_ranks(overwrite_latest, 2, tmp_path, config, 1)  # B, while A waits at its gate
        promoters = [Promoter(config, node=n) for n in (0, 1)]
        for promoter in (promoters[1], promoters[0]):
            promoter.run_once()
    finally:
        Path(gate.release).touch()
        a.join()
    ram0 = make_tier(config.tiers[0], namespace=None, node=0)
    shared = make_tier(config.tier("shared"), namespace=None, node=0)
    b = read_manifest(shared, "latest", trust=MarkerTrust())
    committed_last = read_manifest(ram0, "latest", trust=MarkerTrust())
    assert committed_last.generation != b.generation
    assert (committed_last.seq or 0) > (b.seq or 0), "the last commit ranks newest"
    for promoter in (promoters[0], promoters[1], promoters[0]):
        promoter.run_once()
    assert read_manifest(shared, "latest", trust=MarkerTrust()).generation == committed_last.generation


def veto_once(view: Any) -> str | None:
    """Rank 0's gate refuses the third save (rank 1 has written its part by then)."""
    return "refused" if view.rank == 0 and int(view.value("model.w0")[0]) == 2 else None


def overwrite_in_one_job(rank: int, world: int, config: Config) -> None:
    """One job overwrites ``latest`` five times; the third save fails at rank 0's gate."""
    for step in range(5):
        writer = TieredWriter(config, node=rank, overwrite=True, commit_gate=veto_once)
        try:
            state = {"model": {f"w{rank}": torch.full((40_000,), float(step))}}
            dcp.save(state, storage_writer=writer, checkpoint_id="latest")
        except CheckpointException:
            assert step == 2, f"save {step} failed"


def test_the_coordinator_tells_the_other_node_what_became_of_its_saves(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """A memory tier alone (nothing job-wide for a promoter to learn from): at each save the
    coordinator tells node 1 what became of its previous saves, so node 1 drops its parts of the
    replaced and the failed ones, and confirms the final number of the committed one."""
    config = make_config("memory")
    run_ranks(overwrite_in_one_job, 2, tmp_path, config)
    ram0, ram1 = (make_tier(config.tiers[0], namespace=None, node=n) for n in (0, 1))
    current = read_manifest(ram0, "latest", trust=MarkerTrust()).generation
    held = foreign_parts(ram1)["latest"]
    # The last save's part, and the one it replaced (dropped at the next save's plan): no more.
    assert current in held and len(held) == 2, sorted(held)
    (previous,) = set(held) - {current}
    assert all(record.confirmed for record in held[previous])


def overwrite_latest_with(rank: int, world: int, config: Config, value: float) -> None:
    writer = TieredWriter(config, node=rank, overwrite=True)
    state = {"model": {f"w{rank}": torch.full((40_000,), value)}}
    dcp.save(state, storage_writer=writer, checkpoint_id="latest")


def load_latest(rank: int, world: int, config: Config, out: str) -> None:
    target = {"model": {f"w{rank}": torch.zeros(40_000)}}
    try:
        dcp.load(target, storage_reader=TieredReader(config, node=rank), checkpoint_id="latest")
        Path(out, f"rank{rank}").write_text(str(float(target["model"][f"w{rank}"][0])))
    except CheckpointException as exc:
        assert "no tier holds a usable committed copy" in str(exc), exc
        Path(out, f"rank{rank}").write_text("no usable copy")


def test_an_older_generation_is_not_served_when_the_newest_commit_cannot_be_read(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """memory -> shared, no mirror. ``latest`` saved on two nodes and promoted; overwritten, the new
    commit not promoted yet. A restore on two nodes cannot read the memory copy (its files are
    spread over the nodes), and must not fall back to the shared tier's older generation."""
    config = make_config("memory", "shared")
    run_ranks(overwrite_latest_with, 2, tmp_path, config, 1.0)
    for node in (1, 0):
        Promoter(config, node=node).run_once()
    run_ranks(overwrite_latest_with, 2, tmp_path, config, 2.0)
    run_ranks(load_latest, 2, tmp_path, config, str(tmp_path))
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["no usable copy"] * 2


def test_a_crashed_overwrite_does_not_hide_the_next_commit_after_the_coordinators_node_is_lost(
    tmp_path: Path,
) -> None:
    """``latest`` saved; an overwrite crashes after node 1 wrote its part (its number stays the
    planned one); the restarted job overwrites ``latest`` again, mirrored; node 0 is lost. The
    crashed save's part is no evidence against the later commit: it restores from memory."""
    config = mirror_config(tmp_path, lower=(), keep=2)
    pids = tmp_path / "pids"
    pids.mkdir()
    gate = CrashWhenPartWritten(str(memory_root(tmp_path, 1) / "latest/*/parts/rank*.json"), str(pids))
    with contextlib.suppress(Exception):  # the job is killed on purpose
        run_ranks(save_then_crash_an_overwrite, 2, tmp_path, config, gate)
    plan = [("latest", 3, SMALL, {"overwrite": True})]
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), plan)
    shutil.rmtree(memory_root(tmp_path, 0))
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "latest", ("memory", 3), SMALL)
