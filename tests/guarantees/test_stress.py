"""Stress: saves, overwrites, rollbacks, ``tier=`` saves and restores, while a promoter and a gc run
concurrently; then several nodes with two ranks each and two promoter processes. Bounded and seeded.

After each run the audit of ``tierstore verify --all`` finds no marker over missing or wrong data, and
every committed id restores bit-exact to the content of its last commit.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.workers import run_ranks
from tierstore import Catalog, TieredReader, TieredWriter, latest_committed
from tierstore.cli.audit import audit_all
from tierstore.config import Config
from tierstore.promote.sidecar import Promoter

NUMEL = 64 * 1024


def content(value: float) -> dict[str, Any]:
    return {"w": torch.full((NUMEL,), value), "b": torch.arange(7) * int(value), "v": value}


def restores_to(config: Config, checkpoint_id: str, value: float) -> None:
    target = content(-1.0)
    reader = TieredReader(config, verify=True)
    dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
    assert target["v"] == value, f"{checkpoint_id} from {reader.chosen_tier}: stale content"
    assert torch.equal(target["w"], torch.full((NUMEL,), value))
    assert torch.equal(target["b"], torch.arange(7) * int(value))


def background(config: Config, stop: threading.Event, errors: list[BaseException]) -> None:
    """A promoter pass (promotion, retention, cleanup) again and again, and a gc in between."""
    promoter = Promoter(config)
    while not stop.is_set():
        try:
            promoter.run_once()
            promoter.apply_retention(promoter.catalog())
            promoter.collect_garbage(dry_run=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            return


@pytest.mark.slow  # a 30 s concurrency sweep per seed: make test runs it, make quick does not
@pytest.mark.parametrize("seed", [11, 29])
def test_one_node_under_concurrent_promotion_and_gc(seed: int, make_config: Callable[..., Config]) -> None:
    config = make_config(
        "memory",
        "local",
        "s3",
        tiers={"memory": {"keep": 3}, "local": {"keep": 4}, "s3": {"keep": 6, "every": 2}},
        promote={"stale_after": 0, "activity_ttl": 2},
    )
    rng = random.Random(seed)  # noqa: S311 - a reproducible schedule, not a secret
    expected: dict[str, float] = {}
    last_committed: str | None = None
    stop, errors = threading.Event(), []  # type: ignore[var-annotated]
    worker = threading.Thread(target=background, args=(config, stop, errors))
    worker.start()
    try:
        step = 100
        for value in range(1, 31):
            op = rng.choice(["save", "save", "async", "overwrite", "rollback", "tier", "restore"])
            if op == "restore" and expected:
                name = rng.choice(sorted(expected))
                if name in Catalog(config).scan():  # retention may have let it go everywhere
                    restores_to(config, name, expected[name])
                continue
            overwrite = op == "overwrite" and bool(expected)
            if overwrite:
                name = rng.choice(sorted(expected))
            else:
                step += rng.randint(-30, -5) if op == "rollback" else 10
                name = f"step_{step:06d}-{value}"
            writer = TieredWriter(config, overwrite=overwrite, tier="s3" if op == "tier" else None)
            if op == "async":
                dcp.async_save(content(value), storage_writer=writer, checkpoint_id=name).result()
            else:
                dcp.save(content(value), storage_writer=writer, checkpoint_id=name)
            expected[name], last_committed = float(value), name
    finally:
        stop.set()
        worker.join()
    assert errors == []
    for _ in range(3):
        Promoter(config).run_once()
    assert [a for a in audit_all(config, [0]) if not a.ok] == []
    assert latest_committed(config) == last_committed, "newest is the last commit"
    held = Catalog(config).scan()
    assert last_committed in held
    for name in held:
        restores_to(config, name, expected[name])


def save_round(rank: int, world: int, config: Config, values: list[int]) -> None:
    node = rank // 2
    writer = TieredWriter(config, node=node)
    for value in values:
        mine = {f"r{rank}": torch.full((NUMEL,), float(value) + rank)}
        dcp.async_save(
            {"model": mine, "v": value}, storage_writer=writer, checkpoint_id=f"step_{value:06d}"
        ).result()
    writer.close()


def test_two_nodes_two_ranks_each_with_promoters_running(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config(
        "memory",
        "s3",
        tiers={"memory": {"keep": 2}},
        promote={"stale_after": 0, "activity_ttl": 2, "interval": "100ms"},
    )
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    command = [sys.executable, "-m", "tierstore.cli", "--config", str(path), "--node"]
    promoters = [
        subprocess.Popen([*command, str(node), "promote"], stderr=subprocess.DEVNULL) for node in (0, 1)
    ]
    try:
        run_ranks(save_round, 4, tmp_path, config, [1, 2, 3, 4, 5])
    finally:
        for process in promoters:
            process.send_signal(signal.SIGTERM)
        assert [process.wait(timeout=60) for process in promoters] == [0, 0]
    # The drain, one node at a time, with leftovers left alone for an hour: at stale_after 0 the
    # keeper of S3 (whichever drain holds its lease) would clean a part another node promoted whose
    # coordinator's marker is the next drain's, and the two parts would never stand together.
    drained = config.model_dump(exclude={"origin"}, exclude_none=True)
    drained["promote"]["stale_after"] = "1h"
    path.write_text(yaml.safe_dump(drained))
    for node in (1, 0, 1, 0):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tierstore.cli",
                "--config",
                str(path),
                "--node",
                str(node),
                "promote",
                "--once",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    assert [a for a in audit_all(config, [0, 1]) if not a.ok] == []
    s3 = config.make_tier("s3", node=0)
    assert s3.exists("step_000005/commit.json"), "the newest save is durable"
    target = {"model": {f"r{r}": torch.zeros(NUMEL) for r in range(4)}, "v": 0}
    reader = TieredReader(config)
    dcp.load(target, storage_reader=reader, checkpoint_id="step_000005")
    assert reader.chosen_tier == "s3" and target["v"] == 5
    assert all(torch.equal(target["model"][f"r{r}"], torch.full((NUMEL,), 5.0 + r)) for r in range(4))
