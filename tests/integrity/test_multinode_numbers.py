"""A multi-node save planned first and committed last takes a new number at its commit; the other
nodes' part records hold the planned one until it is confirmed. Nothing may judge a part by a planned
number: not retention, not the drop of replaced parts, not the mirror's stale-copy rule.

Each test is a reproduction by an adversarial review: save A of an id is planned (its number claimed)
and held at rank 0's commit gate, save B commits meanwhile, A commits last under a higher number.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from tests.guarantees.test_multinode import HoldRank
from tests.integrity.test_multinode_parts import wait_for
from tests.mirror_jobs import become
from tests.workers import run_ranks
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import copy_problems, read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier

A, B = 100.0, 1.0
"""The values the saves hold: A is planned first and commits last, B commits in between."""


def state(rank: int, value: float, size: int) -> dict[str, Any]:
    return {"model": {f"w{rank}": torch.full((size,), value)}}


def save(  # noqa: PLR0917 - torch.multiprocessing passes arguments by position
    rank: int,
    world: int,
    config: Config,
    checkpoint_id: str,
    value: float,
    size: int,
    gate: HoldRank | None = None,
) -> None:
    become(rank)
    writer = TieredWriter(config, node=rank, overwrite=True, commit_gate=gate)
    dcp.save(state(rank, value, size), storage_writer=writer, checkpoint_id=checkpoint_id)
    writer.close()


def load(  # noqa: PLR0917 - torch.multiprocessing passes arguments by position
    rank: int, world: int, config: Config, checkpoint_id: str, size: int, out: str
) -> None:
    """Resume: what ``latest_committed`` names, and what loading ``checkpoint_id`` gives (or the
    error), written to ``out`` for the test to judge."""
    become(rank)
    latest = latest_committed(config, node=rank)
    target = state(rank, -1.0, size)
    try:
        dcp.load(target, storage_reader=TieredReader(config, node=rank), checkpoint_id=checkpoint_id)
        got = str(target["model"][f"w{rank}"][0].item())
    except CheckpointException as exc:
        got = "no usable copy" if "no tier holds a usable committed copy" in str(exc) else str(exc)
    Path(out, f"rank{rank}").write_text(f"{latest}|{got}")


def a_commits_last(
    tmp_path: Path, config: Config, ids: tuple[str, str], size: int, between: Callable[[], None]
) -> None:
    """Save A of ``ids[0]`` held at its gate, save B of ``ids[1]`` (then ``between()``), A commits
    last."""
    a, b = ids
    gate = HoldRank(0, str(tmp_path / "release"), str(tmp_path / "reached"))
    (tmp_path / "a").mkdir()
    job = threading.Thread(target=run_ranks, args=(save, 2, tmp_path / "a", config, a, A, size, gate))
    job.start()
    try:
        wait_for(gate.reached)
        run_ranks(save, 2, tmp_path, config, b, B, size)
        between()
    finally:
        Path(gate.release).touch()
        job.join()


def export_on_node_1(
    tmp_path: Path, tiers: list[dict[str, Any]], checkpoint_id: str
) -> subprocess.CompletedProcess[str]:
    """``tierstore --node 1 restore ID --to DIR``: an export on node 1 alone."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"tiers": tiers}))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "--config",
            str(path),
            "--node",
            "1",
            "restore",
            checkpoint_id,
            "--to",
            str(tmp_path / "export"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def resumed(tmp_path: Path, config: Config, checkpoint_id: str, size: int) -> list[str]:
    run_ranks(load, 2, tmp_path, config, checkpoint_id, size, str(tmp_path))
    return [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]


def test_a_part_whose_number_is_unconfirmed_is_never_judged_by_it(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """memory -> shared, ``stale_after: 1s``. After A commits, node 1's promoter runs before node 0's
    has left A's committed manifest in shared: node 1's part of A (planned number below B's) stays,
    and the promoters then replace B with A in shared."""
    config = make_config("memory", "shared", promote={"stale_after": "1s"})
    promoters = [Promoter(config, node=n) for n in (0, 1)]
    a_commits_last(
        tmp_path, config, ("latest", "latest"), 20_000, lambda: [promoters[n].run_once() for n in (1, 0)]
    )
    ram0, ram1 = (make_tier(config.tiers[0], namespace=None, node=n) for n in (0, 1))
    committed_last = read_manifest(ram0, "latest", trust=MarkerTrust())
    time.sleep(1.2)  # node 1's part of A is older than stale_after
    promoters[1].run_once()
    node1 = [f for f in committed_last.files if f.node == 1]
    assert copy_problems(ram1, committed_last, verify=False, entries=node1) == []
    for node in (0, 1, 0, 1):
        promoters[node].run_once()
    shared = make_tier(config.tier("shared"), namespace=None, node=0)
    assert read_manifest(shared, "latest", trust=MarkerTrust()).generation == committed_last.generation


def test_retention_on_another_node_never_ranks_parts_by_their_planned_numbers(tmp_path: Path) -> None:
    """A mirrored memory tier alone, ``keep: 1``; A saves id ``a``, B saves id ``b``. ``a`` is the
    newest: node 1's retention must not delete its part of ``a`` (ranked by the planned number,
    below ``b``'s). Node 0 is then lost: ``a`` restores from node 1's memory and its mirrors."""
    tiers = [
        {"name": "memory", "type": "memory", "path": f"{tmp_path}/mem/{{node}}", "keep": 1, "mirror": True}
    ]
    config = config_from_dict({"tiers": tiers}, check_paths=False)
    a_commits_last(tmp_path, config, ("a", "b"), 20_000, lambda: None)
    for node in (1, 0):
        Promoter(config, node=node).run_once()
    shutil.rmtree(tmp_path / "mem" / "0")
    assert resumed(tmp_path, config, "a", 20_000) == [f"a|{A}"] * 2


def test_a_mirror_older_than_a_part_with_an_unconfirmed_number_is_never_served(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path]
) -> None:
    """A mirrored memory tier alone; both saves overwrite ``X``. B is mirrored; A's mirror does not
    fit on node 1 (reduced redundancy). Node 1 holds B's mirror and its part of A with the planned
    number (below B's). Neither an export on node 1 nor a restart after node 0 is lost may serve B:
    A is the last commit."""
    (tmp_path / "mem").mkdir()
    memory1 = mount_tmpfs("24m")
    (tmp_path / "mem" / "1").symlink_to(memory1)
    tiers = [
        {
            "name": "memory",
            "type": "memory",
            "path": f"{tmp_path}/mem/{{node}}",
            "keep": 2,
            "mirror": {"timeout": "20s"},
        }
    ]
    config = config_from_dict({"tiers": tiers}, check_paths=False)
    size = 250_000  # 1 MB shards

    def fill_node_1() -> None:
        free = shutil.disk_usage(memory1).free
        (memory1 / "filler").write_bytes(b"\0" * (free - 8 * 2**20))

    a_commits_last(tmp_path, config, ("X", "X"), size, fill_node_1)
    (memory1 / "filler").unlink()
    export = export_on_node_1(tmp_path, tiers, "X")
    assert export.returncode != 0, "node 1 exported B's contents under X"
    assert "evidence of a newer save" in export.stderr, export.stderr
    shutil.rmtree(tmp_path / "mem" / "0")
    assert [line.split("|")[1] for line in resumed(tmp_path, config, "X", size)] == ["no usable copy"] * 2


def test_a_part_of_a_save_in_flight_survives_another_save_of_its_id(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """``latest`` committed; save A of it is held at its gate longer than ``stale_after``; save B
    of it (another job) is planned and commits meanwhile. A commits last: its part on node 1 must
    still be there (B's plan names the id's current marker, which is not A's generation)."""
    config = make_config("memory", "shared", promote={"stale_after": "1s"})
    run_ranks(save, 2, tmp_path, config, "latest", 7.0, 20_000)
    gate = HoldRank(0, str(tmp_path / "release"), str(tmp_path / "reached"))
    (tmp_path / "a").mkdir()
    job = threading.Thread(
        target=run_ranks, args=(save, 2, tmp_path / "a", config, "latest", A, 20_000, gate)
    )
    job.start()
    try:
        wait_for(gate.reached)
        time.sleep(1.5)  # A's part on node 1 is older than stale_after when B is planned
        run_ranks(save, 2, tmp_path, config, "latest", B, 20_000)
    finally:
        Path(gate.release).touch()
        job.join()
    ram0, ram1 = (make_tier(config.tiers[0], namespace=None, node=n) for n in (0, 1))
    committed_last = read_manifest(ram0, "latest", trust=MarkerTrust())
    node1 = [f for f in committed_last.files if f.node == 1]
    assert copy_problems(ram1, committed_last, verify=False, entries=node1) == []


def test_memory_refused_for_a_newer_commit_never_falls_back_to_an_older_generation(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path]
) -> None:
    """A mirrored memory tier above shared. ``X`` saved (mirrored, promoted to shared), then
    overwritten; the overwrite's mirror does not fit on node 1 and it is not promoted yet. Node 1
    holds evidence of the newer commit (its own part): memory is refused, and so must be shared's
    older generation, in an export on node 1 and in a restart after node 0 is lost."""
    (tmp_path / "mem").mkdir()
    memory1 = mount_tmpfs("24m")
    (tmp_path / "mem" / "1").symlink_to(memory1)
    tiers = [
        {
            "name": "memory",
            "type": "memory",
            "path": f"{tmp_path}/mem/{{node}}",
            "mirror": {"timeout": "20s"},
        },
        {"name": "shared", "type": "shared", "path": f"{tmp_path}/shared"},
    ]
    config = config_from_dict({"tiers": tiers}, check_paths=False)
    size = 250_000
    run_ranks(save, 2, tmp_path, config, "X", B, size)
    for node in (1, 0):
        Promoter(config, node=node).run_once()
    (memory1 / "filler").write_bytes(b"\0" * (shutil.disk_usage(memory1).free - 8 * 2**20))
    run_ranks(save, 2, tmp_path, config, "X", A, size)
    (memory1 / "filler").unlink()
    export = export_on_node_1(tmp_path, tiers, "X")
    assert export.returncode != 0, f"node 1 exported the replaced contents: {export.stdout}"
    shutil.rmtree(tmp_path / "mem" / "0")
    assert [line.split("|")[1] for line in resumed(tmp_path, config, "X", size)] == ["no usable copy"] * 2
