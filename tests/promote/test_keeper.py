"""One keeper per job-wide tier, with real promoter processes of simulated nodes (a tier root per
node, one host name each): one keeper; a keeper killed with SIGKILL is replaced within three lease
durations; a keeper paused by SIGSTOP after deciding a deletion, resumed after the takeover, deletes
nothing and says it lost the lease."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tierstore import TieredWriter
from tierstore.config import Config, config_from_dict
from tierstore.ids import marker_path
from tierstore.records.lease import newest_epoch, read_lease
from tierstore.tiers import Tier, make_tier

LEASE = 1.5
"""Seconds: short, so that a takeover takes seconds."""
SLACK = 1.5
"""Seconds a loaded 2-core machine may add to a bound (scheduling, a process's start)."""


class Node:
    """One simulated node's promoter process; its log in a file."""

    def __init__(self, config: Path, node: int, log: Path, **env: str) -> None:
        self.node, self.log = node, log
        argv = [sys.executable, "-m", "tierstore.cli", "--config", str(config), "--node", str(node), "-v"]
        environment = {**os.environ, "TIERSTORE_HOST": f"host-{node}", **env}
        with log.open("w") as out:
            argv += ["promote", "--metrics-port", "0"]
            self.process = subprocess.Popen(argv, stderr=out, env=environment)

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, timeout: float = 60) -> float:
        """Wait until the log holds ``pattern`` (a regex); the monotonic time it was found."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            assert self.process.poll() is None or re.search(pattern, self.text()), self.text()
            assert time.monotonic() < deadline, f"node {self.node} never logged {pattern!r}:\n{self.text()}"
            time.sleep(0.05)
        return time.monotonic()

    def keeps(self, tier: str) -> float | None:
        """The ``tierstore_keeper`` gauge of ``tier`` on its /metrics."""
        port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", self.text())
        assert port is not None, self.text()
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10) as answer:
            body = answer.read().decode()
        found = re.search(rf'^tierstore_keeper{{tier="{tier}"}} (\S+)$', body, re.M)
        return None if found is None else float(found.group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            self.process.wait(timeout=60)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    started: list[Node] = []

    def start(config: Path, node: int, **env: str) -> Node:
        started.append(Node(config, node, tmp_path / f"node{node}.log", **env))
        return started[-1]

    yield start
    for node in started:
        node.stop()


def write_config(tmp_path: Path, name: str, specs: list[dict[str, Any]], **shared: Any) -> Path:
    for spec in specs:
        spec.update(shared.get(spec["name"], {}))
    body = {"tiers": specs, "promote": {"interval": "0.3s", "keeper_lease": f"{LEASE}s"}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return path


def local_specs(tmp_path: Path, wide: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A memory tier per node and one job-wide tier called pfs (``wide``: its spec, else a shared
    directory)."""
    return [
        {"name": "ram", "type": "memory", "path": str(tmp_path / "ram/{node}")},
        {"name": "pfs", **(wide or {"type": "shared", "path": str(tmp_path / "pfs")})},
    ]


def tier_of(path: Path, name: str) -> Tier:
    config = config_from_dict(yaml.safe_load(path.read_text()))
    return make_tier(config.tier(name), namespace=None, node=0)


def save_into(config: Config, checkpoint_id: str, tier: str) -> None:
    state = {"w": torch.arange(100, dtype=torch.float32), "step": int(checkpoint_id.rsplit("_", 1)[-1])}
    dcp.save(state, storage_writer=TieredWriter(config, tier=tier), checkpoint_id=checkpoint_id)


def keeper_lines(node: Node, tier: str) -> list[str]:
    return re.findall(rf"keeper_(?:taken|lost) tier={tier} epoch=\d+", node.text())


@pytest.mark.parametrize("wide", ["shared", "s3"])
def test_one_keeper_and_a_killed_one_is_replaced_within_three_leases(
    tmp_path: Path, nodes: Callable[..., Node], wide: str, request: pytest.FixtureRequest
) -> None:
    spec = None
    if wide == "s3":
        bucket, endpoint = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint")
        spec = {"type": "s3", "url": f"s3://{bucket}/ckpt", "endpoint_url": endpoint}
    path = write_config(tmp_path, "job.yaml", local_specs(tmp_path, spec), pfs={"keep": 1})
    first = nodes(path, 0)
    first.wait_for("keeper_taken tier=pfs epoch=1")
    others = [nodes(path, 1), nodes(path, 2)]
    for other in others:
        other.wait_for("promoter_started")
    time.sleep(2 * LEASE)  # two leases renewed while the others watch
    assert [keeper_lines(n, "pfs") for n in others] == [[], []], "one keeper"
    assert [n.keeps("pfs") for n in (first, *others)] == [1.0, 0.0, 0.0]

    os.kill(first.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    first.process.wait()
    deadline = killed + 3 * LEASE + SLACK + 30  # the takeover is timed below; this only ends the wait
    while not any("keeper_taken tier=pfs epoch=2" in n.text() for n in others):
        assert time.monotonic() < deadline, [n.text() for n in others]
        time.sleep(0.02)
    took = time.monotonic() - killed
    assert took <= 3 * LEASE + SLACK, f"taken over {took:.1f} s after the kill (lease {LEASE} s)"
    winners = [n for n in others if "keeper_taken tier=pfs epoch=2" in n.text()]
    assert len(winners) == 1, "exactly one takes epoch 2"
    time.sleep(LEASE)
    assert sorted(n.keeps("pfs") or 0.0 for n in others) == [0.0, 1.0]
    assert newest_epoch(tier_of(path, "pfs")) == 2

    # the new keeper does the keeper's work, the other does not: retention in the job-wide tier
    config = config_from_dict(yaml.safe_load(path.read_text()))
    for step in (1, 2):
        save_into(config, f"step_{step:04d}", "pfs")
    winners[0].wait_for("deleted checkpoint=step_0001 tier=pfs")
    assert not tier_of(path, "pfs").exists(marker_path("step_0001"))
    assert all("deleted checkpoint=" not in n.text() for n in others if n is not winners[0])


def test_a_paused_keeper_resumed_after_the_takeover_deletes_nothing(
    tmp_path: Path, nodes: Callable[..., Node]
) -> None:
    """The keeper stops itself (SIGSTOP) right after its retention decided to delete step_0001 from
    the job-wide tier, before deleting it. Another node (whose configuration keeps every checkpoint)
    takes over; resumed, the old keeper's fence sees the higher epoch: step_0001 stays, its log says
    it lost the lease and deleted nothing, and its gauge is 0."""
    deleting = write_config(tmp_path, "keep1.yaml", local_specs(tmp_path), pfs={"keep": 1})
    keeping = write_config(tmp_path, "keepall.yaml", local_specs(tmp_path))
    config = config_from_dict(yaml.safe_load(deleting.read_text()))
    for step in (1, 2):
        save_into(config, f"step_{step:04d}", "pfs")
    pfs = tier_of(deleting, "pfs")
    old = nodes(
        deleting, 0, TIERSTORE_KILL_POINT="retention.decided@pfs/step_0001", TIERSTORE_KILL_SIGNAL="SIGSTOP"
    )
    old.wait_for("kill point retention.decided reached")
    assert "keeper_taken tier=pfs epoch=1" in old.text()
    new = nodes(keeping, 1)
    new.wait_for("keeper_taken tier=pfs epoch=2", timeout=3 * LEASE + 60)
    assert read_lease(pfs, 2).holder.node == 1

    os.kill(old.process.pid, signal.SIGCONT)
    old.wait_for("keeper_lost tier=pfs epoch=1")
    time.sleep(3 * 0.3 + LEASE)  # several passes of both
    assert pfs.exists(marker_path("step_0001")), "the paused keeper deleted after the takeover"
    assert "deleted checkpoint=" not in old.text()
    assert old.keeps("pfs") == 0.0 and new.keeps("pfs") == 1.0
    assert "keeper_taken" not in old.text().split("keeper_lost tier=pfs epoch=1", 1)[1], "it stays a watcher"


def test_gc_leaves_a_tier_another_promoter_keeps(tmp_path: Path, nodes: Callable[..., Node]) -> None:
    """``tierstore gc`` on another node (whose configuration would delete) leaves the kept tier to
    its keeper and says so; with the keeper stopped (its lease released), gc cleans it."""
    deleting = write_config(tmp_path, "keep1.yaml", local_specs(tmp_path), pfs={"keep": 1})
    keeping = write_config(tmp_path, "keepall.yaml", local_specs(tmp_path))
    config = config_from_dict(yaml.safe_load(deleting.read_text()))
    for step in (1, 2):
        save_into(config, f"step_{step:04d}", "pfs")
    keeper = nodes(keeping, 0)
    keeper.wait_for("keeper_taken tier=pfs epoch=1")
    argv = [sys.executable, "-m", "tierstore.cli", "--config", str(deleting), "--node", "1", "gc"]
    environment = {**os.environ, "TIERSTORE_HOST": "host-1"}
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env=environment)
    assert "tier pfs is kept by another node's promoter" in done.stdout
    assert tier_of(deleting, "pfs").exists(marker_path("step_0001"))
    keeper.stop()
    assert "keeper_lost tier=pfs epoch=1 reason=released" in keeper.text()
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env=environment)
    assert "deleted step_0001 from pfs" in done.stdout, done.stdout
    assert not tier_of(deleting, "pfs").exists(marker_path("step_0001"))
