"""Stress of the mirrored memory tier: two nodes save, overwrite and restore the same ids while both
nodes' promoters promote, apply retention and gc (a short ``stale_after``) in the background; midway
the coordinator's node is replaced (its memory empty, a new host) and the job restarts.

After the run the audit of ``tierstore verify --all`` finds no marker over missing or wrong data, and
every committed id restores bit-exact to the content of its last commit.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.mirror_jobs import blank_state, memory_root, shard_state
from tests.workers import run_ranks
from tierstore import Catalog, TieredReader, TieredWriter, latest_committed
from tierstore.cli.audit import audit_all
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.topology import HOST_VARIABLE

SIZE = 20_000
LATEST = 1000
"""``latest`` saved in round r holds the state of step ``LATEST + r``."""


def stress_config(root: Path) -> Config:
    tiers = [
        {"name": "memory", "type": "memory", "path": f"{root}/mem/{{node}}", "keep": 2, "mirror": True},
        {"name": "shared", "type": "shared", "path": f"{root}/shared"},
    ]
    promote = {"stale_after": "1s", "activity_ttl": "2s", "interval": "100ms"}
    return config_from_dict({"tiers": tiers, "promote": promote}, check_paths=False)


def load_and_check(config: Config, node: int, checkpoint_id: str, step: int, ranks: int) -> None:
    """Every saved rank's shard (all of them when ``ranks`` is the world size) loads bit-exact."""
    mine = list(range(ranks))
    target = blank_state(mine, SIZE)
    dcp.load(target, storage_reader=TieredReader(config, node=node), checkpoint_id=checkpoint_id)
    for saved in mine:
        expected = shard_state(saved, step, SIZE)["model"][f"shard{saved}"]
        assert torch.equal(target["model"][f"shard{saved}"], expected), (checkpoint_id, saved)
    assert target["step"] == step, (checkpoint_id, target["step"], step)


def rounds(  # noqa: PLR0917 - torch.multiprocessing passes arguments by position
    rank: int, world: int, config: Config, hosts: Sequence[str], numbers: Sequence[int], resume: int | None
) -> None:
    """One job: resume (``latest`` must hold round ``resume``), then for each round save a fresh
    id, overwrite ``latest``, and restore both."""
    os.environ[HOST_VARIABLE] = hosts[rank]
    if resume is not None:
        assert latest_committed(config, node=rank) == "latest"
        load_and_check(config, rank, "latest", LATEST + resume, world)
    for number in numbers:
        writer = TieredWriter(config, node=rank)
        dcp.save(shard_state(rank, number, SIZE), storage_writer=writer, checkpoint_id=f"step_{number}")
        overwrite = TieredWriter(config, node=rank, overwrite=True)
        dcp.save(shard_state(rank, LATEST + number, SIZE), storage_writer=overwrite, checkpoint_id="latest")
        assert writer.wait_mirrored(60) and overwrite.wait_mirrored(60)
        load_and_check(config, rank, f"step_{number}", number, world)
        load_and_check(config, rank, "latest", LATEST + number, world)
        writer.close()
        overwrite.close()
    dist.barrier()


def promote_until(config: Config, node: int, stop: threading.Event, errors: list[Any]) -> None:
    """A node's sidecar: passes (promotion, retention, gc when due) until ``stop``."""
    promoter = Promoter(config, node=node)
    while not stop.is_set():
        try:
            promoter.run_once()
            promoter.collect_garbage(dry_run=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            return
        stop.wait(0.1)


def start_sidecar(config: Config, node: int, errors: list[Any]) -> tuple[threading.Thread, threading.Event]:
    """Start ``node``'s sidecar thread; set the returned event to stop it."""
    stop = threading.Event()
    sidecar = threading.Thread(target=promote_until, args=(config, node, stop, errors))
    sidecar.start()
    return sidecar, stop


def test_saves_overwrites_and_restores_with_promoters_gc_and_a_replaced_node(tmp_path: Path) -> None:
    config = stress_config(tmp_path)
    errors: list[Any] = []
    sidecars = {node: start_sidecar(config, node, errors) for node in (0, 1)}
    try:
        run_ranks(rounds, 2, tmp_path, config, ["host-a", "host-b"], [1, 2, 3, 4], None)
        # The coordinator's node is replaced: its sidecar goes with the host, its memory is empty.
        old_sidecar, old_stop = sidecars.pop(0)
        old_stop.set()
        old_sidecar.join()
        shutil.rmtree(memory_root(tmp_path, 0))
        sidecars[0] = start_sidecar(config, 0, errors)
        run_ranks(rounds, 2, tmp_path, config, ["host-c", "host-b"], [5, 6, 7, 8], 4)
    finally:
        for sidecar, stop in sidecars.values():
            stop.set()
            sidecar.join()
    assert errors == []
    # A node's part whose commit number it never saw confirmed is judged once stale_after passed.
    time.sleep(config.promote.stale_after + 0.5)
    promoters = [Promoter(config, node=node) for node in (0, 1)]
    for node in (1, 0, 1, 0):
        promoters[node].run_once()
    assert [a for a in audit_all(config, [0, 1]) if not a.ok] == []
    for node in (0, 1):  # host memory holds what retention keeps, on every node: no leak
        kept = {
            d.name: sorted(g.name for g in d.iterdir() if g.name.startswith("g"))
            for d in memory_root(tmp_path, node).iterdir()
            if not d.name.startswith(".")
        }
        assert len(kept) <= 2 and all(len(g) == 1 for g in kept.values()), (node, kept)
    assert latest_committed(config) == "latest"
    held = Catalog(config).scan()
    assert {f"step_{n}" for n in range(1, 9)} | {"latest"} <= set(held)
    for checkpoint_id in held:
        step = LATEST + 8 if checkpoint_id == "latest" else int(checkpoint_id.split("_")[1])
        load_and_check(config, 0, checkpoint_id, step, 2)
