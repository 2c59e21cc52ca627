"""Peer-mirrored host memory: a lost node's shards come back from its partner's memory.

Real ranks (gloo on loopback), simulated nodes (one memory root and one host name per node). The lower
tiers stay empty unless a test fills them: a restore that reads them would fail, which proves nothing
slower than host memory was read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp
import yaml

from tests.mirror_jobs import (
    load_and_check,
    memory_root,
    mirror_config,
    mirror_markers,
    save_and_linger,
    save_on_hosts,
    save_steps,
)
from tests.workers import run_ranks
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.mirror import MirrorMarker

TWO_NODES = (0, 0, 1, 1)


def status_of(root: Path, node: int, checkpoint_id: str) -> dict[str, object]:
    """The owner's record of whether its files of ``checkpoint_id`` reached a mirror."""
    (found,) = memory_root(root, node).glob(f"{checkpoint_id}/*/mirror/node{node:05d}.json")
    return dict(json.loads(found.read_text()))


@pytest.fixture(scope="module")
def saved_on_two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks on 2 nodes saved step_1 and step_2 (once per module; tests work on copies)."""
    root = tmp_path_factory.mktemp("saved-4-ranks")
    run_ranks(save_steps, 4, root, mirror_config(root), TWO_NODES, (1, 2), "sync", root)
    return root


@pytest.fixture(scope="module")
def promoted_two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks on 2 nodes saved step_1, also promoted to the shared tier (as the promoter would)."""
    root = tmp_path_factory.mktemp("saved-2-ranks")
    config = mirror_config(root, lower=("shared",))
    run_ranks(save_steps, 2, root, config, (0, 1), (1,), "sync", root)
    path = root / "promote.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"}, exclude_none=True)))
    for node in (1, 0):  # node 1's part first; node 0 (the marker's node) then commits
        done = subprocess.run(
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
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    assert (root / "shared" / marker_path("step_1")).exists()
    return root


def copy_of(saved: Path, tmp_path: Path) -> Path:
    """A private copy of a saved job's tiers (the files name no absolute path)."""
    root = tmp_path / "job"
    shutil.copytree(saved, root, symlinks=True, ignore=shutil.ignore_patterns("store-*"))
    return root


def test_every_node_holds_its_partners_mirror(saved_on_two_nodes: Path) -> None:
    root = saved_on_two_nodes
    for node in (0, 1):
        (marker,) = mirror_markers(root, 1 - node, "step_2")
        held = MirrorMarker.from_json(marker.read_bytes(), where=str(marker))
        assert (held.owner_node, held.holder_node) == (node, 1 - node)
        assert held.ranks == ((0, 1) if node == 0 else (2, 3))
        assert mirror_markers(root, 1 - node, "step_1") != [], "keep: 2 keeps both mirrors"
        assert status_of(root, node, "step_2")["mirrored"] is True
    assert (memory_root(root, 0) / marker_path("step_2")).exists()
    assert (memory_root(root, 1) / ".tierstore/mirror/step_2").is_dir(), "marker copy, .metadata"


@pytest.mark.parametrize(
    ("lost", "restart"),
    [(1, TWO_NODES), (0, TWO_NODES), (1, (1, 1, 0, 0))],
    ids=["node-1-lost", "coordinator-node-lost", "indices-swapped"],
)
def test_lost_node_restores_from_partner_memory(
    lost: int, restart: tuple[int, ...], saved_on_two_nodes: Path, tmp_path: Path
) -> None:
    root = copy_of(saved_on_two_nodes, tmp_path)
    shutil.rmtree(memory_root(root, lost))  # the node is replaced: its host memory is empty
    run_ranks(load_and_check, 4, root, mirror_config(root), restart, 2, "memory", (0, 1, 2, 3))
    assert list(root.glob("local/*/step_*")) == list(root.glob("shared/step_*")) == [], (
        "the slower tiers never held a copy: nothing could have been read from them"
    )


def test_lost_part_and_its_mirror_fall_back_to_the_next_tier_on_every_rank(
    promoted_two_nodes: Path, tmp_path: Path
) -> None:
    root = copy_of(promoted_two_nodes, tmp_path)
    shutil.rmtree(memory_root(root, 1))
    shutil.rmtree(memory_root(root, 0) / ".tierstore" / "mirror")
    config = mirror_config(root, lower=("shared",))
    run_ranks(load_and_check, 2, root, config, (0, 1), 1, "shared", (0, 1))


def test_flipped_byte_in_a_mirror_copy_is_detected_and_skipped(
    promoted_two_nodes: Path, tmp_path: Path
) -> None:
    root = copy_of(promoted_two_nodes, tmp_path)
    config = mirror_config(root, lower=("shared",))
    (copy,) = memory_root(root, 0).glob(".tierstore/mirror/step_1/*/r00001-0.distcp")
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0x01
    copy.write_bytes(bytes(data))
    # Node 1 intact: its own copy serves rank 1; the corrupt mirror is never used.
    run_ranks(load_and_check, 2, root, config, (0, 1), 1, "memory", (0, 1))
    # Node 1 lost: the corrupt mirror is the only memory copy of rank 1's shard: skipped.
    shutil.rmtree(memory_root(root, 1))
    run_ranks(load_and_check, 2, root, config, (0, 1), 1, "shared", (0, 1))


def test_world_size_2_to_1_reshards_from_a_mirror(promoted_two_nodes: Path, tmp_path: Path) -> None:
    root = copy_of(promoted_two_nodes, tmp_path)
    shutil.rmtree(memory_root(root, 1))
    config = mirror_config(root, lower=("shared",))
    run_ranks(load_and_check, 1, root, config, (0,), 1, "memory", (0, 1))


def test_a_lone_process_on_the_surviving_node_resumes_from_its_mirrors(
    promoted_two_nodes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_of(promoted_two_nodes, tmp_path)
    shutil.rmtree(memory_root(root, 0))  # the coordinator's node is lost
    monkeypatch.setenv("TIERSTORE_HOST", "sim-host-1")  # this process, without torch.distributed
    load_and_check(0, 1, mirror_config(root, lower=("shared",)), (1,), 1, "memory", (0, 1))


def test_three_nodes_form_a_ring(tmp_path: Path) -> None:
    config = mirror_config(tmp_path)
    run_ranks(save_steps, 3, tmp_path, config, (0, 1, 2), (1,), "sync", tmp_path)
    holders = {}
    for node in (0, 1, 2):
        (marker,) = mirror_markers(tmp_path, node, "step_1")  # each holds exactly one
        held = MirrorMarker.from_json(marker.read_bytes(), where=str(marker))
        holders[held.owner_node] = held.holder_node
    assert holders == {0: 1, 1: 2, 2: 0}
    shutil.rmtree(memory_root(tmp_path, 2))
    run_ranks(load_and_check, 3, tmp_path, config, (0, 1, 2), 1, "memory", (0, 1, 2))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_saves_mirror_in_thread_and_process_modes(mode: str, tmp_path: Path) -> None:
    config = mirror_config(tmp_path)
    run_ranks(save_steps, 2, tmp_path, config, (0, 1), (1, 2), mode, tmp_path)
    shutil.rmtree(memory_root(tmp_path, 0))
    run_ranks(load_and_check, 2, tmp_path, config, (1, 0), 2, "memory", (0, 1))


def test_peer_killed_during_the_exchange_commits_without_a_mirror_then_the_next_save_mirrors(
    tmp_path: Path,
) -> None:
    config = mirror_config(tmp_path, lower=(), timeout="10s")
    store = str(tmp_path / "store")
    # Preloaded by tests.workers; these ranks run in the server's environment (they set their own
    # host variable and need nothing of this test's).
    context = mp.get_context("forkserver")
    ranks = [context.Process(target=save_and_linger, args=(r, 2, store, config, tmp_path)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        marker = memory_root(tmp_path, 0) / marker_path("step_1")
        in_flight = "*/.tierstore/mirror/step_1/*/.*.tmp-*"
        deadline = time.monotonic() + 120
        while not (marker.exists() and list((tmp_path / "mem").glob(in_flight))):
            assert time.monotonic() < deadline, "never saw the commit and a file in flight"
            assert not mirror_markers(tmp_path, 0, "step_1"), "the exchange ended before the kill"
            time.sleep(0.002)
        os.kill(ranks[1].pid or 0, signal.SIGKILL)  # the peer dies mid-exchange
        ended = tmp_path / "exchange-ended0"
        while not ended.exists():
            assert time.monotonic() < deadline + 60, "a dead peer hung the survivor's mirror"
            time.sleep(0.05)
    finally:
        for process in ranks:
            process.kill()
            process.join()
    assert marker.exists(), "the save committed"
    assert mirror_markers(tmp_path, 0, "step_1") == mirror_markers(tmp_path, 1, "step_1") == []
    status = status_of(tmp_path, 0, "step_1")
    assert status["mirrored"] is False and "exchange failed" in str(status["reason"])

    run_ranks(save_steps, 2, tmp_path, config, (0, 1), (2,), "sync", tmp_path)  # the restarted job
    assert status_of(tmp_path, 0, "step_2")["mirrored"] is True
    assert len(mirror_markers(tmp_path, 0, "step_2")) == len(mirror_markers(tmp_path, 1, "step_2")) == 1


def test_a_holder_without_room_fails_that_mirror_cleanly_the_save_commits_and_the_old_mirror_stays(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path]
) -> None:
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "1").symlink_to(mount_tmpfs("24m"))  # node 1's host memory is small
    config = mirror_config(tmp_path, lower=(), keep=1)
    hosts = ("sim-host-0", "sim-host-1")
    # step_1 fits everywhere; step_2's shards (8 MB each) leave node 1 no room for node 0's.
    run_ranks(save_on_hosts, 2, tmp_path, config, (0, 1), hosts, (200_000, 2_000_000))
    assert status_of(tmp_path, 0, "step_1")["mirrored"] is True
    assert (memory_root(tmp_path, 0) / marker_path("step_2")).exists(), "the save committed"
    refused = status_of(tmp_path, 0, "step_2")
    assert refused["mirrored"] is False and "needs" in str(refused["reason"])
    assert str(memory_root(tmp_path, 1)) in str(refused["reason"]), "names the path"
    assert not list(memory_root(tmp_path, 1).glob(".tierstore/mirror/step_2/*/*.distcp"))
    # Double-buffered: with keep 1, node 0's previous mirror stays until a newer one is complete.
    assert len(mirror_markers(tmp_path, 1, "step_1")) == 1
    assert status_of(tmp_path, 1, "step_2")["mirrored"] is True, "node 0 had room for node 1's"
    assert mirror_markers(tmp_path, 0, "step_1") == [], "node 1's older mirror was replaced"
    for node, redundant in ((0, 0.0), (1, 1.0)):  # what each node's promoter exports
        promoter = Promoter(config, node=node)
        promoter.run_once()
        gauge = promoter.metrics.registry.get_sample_value("tierstore_mirror_redundant", {"tier": "memory"})
        assert gauge == redundant, (node, gauge)


def test_partners_on_one_host_are_refused(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=())
    run_ranks(save_on_hosts, 2, tmp_path, config, (0, 1), ("same-box", "same-box"))
    for node in (0, 1):
        status = status_of(tmp_path, node, "step_1")
        assert status["mirrored"] is False and "same host" in str(status["reason"])
    assert not list((tmp_path / "mem").glob("*/.tierstore/mirror/*"))
