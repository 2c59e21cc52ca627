"""Peer mirrors over a job's life: restarts on other nodes, overwrites, retention, a failed receive.

Each test started as a reproduction by an adversarial review (a break of the guarantees in
docs/mirror.md), with real faults: a real small tmpfs, real restarts, nodes really wiped.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from tests.mirror_jobs import (
    check_latest,
    load_step,
    memory_root,
    mirror_config,
    mirror_markers,
    overwrite_back_to_back,
    save_plan,
    save_then_fail_an_overwrite,
)
from tests.workers import run_ranks
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import Manifest

SMALL = 20_000
BIG = 2_000_000  # 8 MB shards


def held_ids(root: Path, node: int, owner: int) -> list[str]:
    """The ids of ``owner``'s mirrors that ``node`` holds."""
    found = memory_root(root, node).glob(f".tierstore/mirror/*/*/mirror-node{owner:05d}.json")
    return sorted(p.parent.parent.name for p in found)


def mirrored(root: Path, node: int, checkpoint_id: str) -> object:
    (found,) = memory_root(root, node).glob(f"{checkpoint_id}/*/mirror/node{node:05d}.json")
    return json.loads(found.read_text())["mirrored"]


def test_commit_order_survives_a_replaced_coordinator_node_and_swapped_indices(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=("shared",), keep=1)
    step = lambda n: (f"step_{n}", n, SMALL, {})  # noqa: E731
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), [step(1), step(2)])
    shutil.rmtree(memory_root(tmp_path, 0))  # the coordinator's node is replaced
    run_ranks(check_latest, 2, tmp_path, config, (0, 1), "step_2")  # from the mirrors
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), [step(3)])  # the job trains on
    run_ranks(check_latest, 2, tmp_path, config, (0, 1), "step_3")
    assert held_ids(tmp_path, 1, 0) == ["step_3"], "keep 1: the newest mirror stays, not step_2's"
    run_ranks(save_plan, 2, tmp_path, config, (1, 0), [step(4)])  # restarted, indices swapped
    run_ranks(check_latest, 2, tmp_path, config, (0, 1), "step_4")
    run_ranks(check_latest, 2, tmp_path, config, (1, 0), "step_4")


def test_an_overwrite_without_a_mirror_never_brings_the_old_contents_back(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path]
) -> None:
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "1").symlink_to(mount_tmpfs("36m"))  # node 1's host memory
    config = mirror_config(tmp_path, lower=("shared",), keep=2)
    plan = [("step_1", 1, BIG, {}), ("step_1", 5, BIG, {"overwrite": True})]
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), plan)
    statuses = sorted(
        json.loads(p.read_text())["mirrored"]
        for p in memory_root(tmp_path, 0).glob("step_1/*/mirror/node00000.json")
    )
    assert statuses == [False], "the overwrite's mirror did not fit (the old one's record is gone)"
    shutil.rmtree(memory_root(tmp_path, 0))  # the coordinator's node is lost
    # Step 1's data must never come back under this id: the newer save's marker is gone with node 0.
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "step_1", None, BIG)


def test_an_overwritten_generation_never_takes_the_mirror_of_an_older_kept_checkpoint(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=("shared",), keep=2)
    plan = [("step_1", 1, SMALL, {}), ("step_2", 2, SMALL, {}), ("step_2", 3, SMALL, {"overwrite": True})]
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), plan)
    Promoter(config, node=0).run_once()  # the memory tier's own retention (keep 2)
    assert held_ids(tmp_path, 1, 0) == ["step_1", "step_2"]
    shutil.rmtree(memory_root(tmp_path, 0))
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "step_1", ("memory", 1), SMALL)


def test_mirrors_of_a_node_that_left_the_job_follow_keep(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), keep=1)
    step = lambda n: (f"step_{n}", n, SMALL, {})  # noqa: E731
    run_ranks(save_plan, 3, tmp_path, config, (0, 1, 2), [step(1)])  # a ring of three
    assert held_ids(tmp_path, 0, 2) == ["step_1"]
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), [step(2), step(3)])  # node 2 left
    assert held_ids(tmp_path, 0, 2) == [] and held_ids(tmp_path, 0, 1) == ["step_3"]
    assert held_ids(tmp_path, 2, 1) == ["step_1"], "node 2 no longer receives mirrors"
    Promoter(config, node=2).run_once()  # ...its promoter's retention: keep 1 of what it holds
    assert held_ids(tmp_path, 2, 1) == ["step_1"], "its newest mirror stays (double-buffered)"


def test_a_receive_that_fails_mid_file_does_not_stop_the_next_saves_from_mirroring(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path]
) -> None:
    # Node 1's place for step_1's mirror is a 1 MiB tmpfs: its room check passes (the tier itself
    # has room), then the write of an 8 MB file fails with a real ENOSPC in the middle.
    full = memory_root(tmp_path, 1) / ".tierstore" / "mirror" / "step_1"
    full.parent.mkdir(parents=True)
    full.symlink_to(mount_tmpfs("1m"))
    config = mirror_config(tmp_path, lower=(), keep=3, timeout="20s")
    plan = [(f"step_{n}", n, BIG, {}) for n in (1, 2, 3)]
    run_ranks(save_plan, 2, tmp_path, config, (0, 1), plan)  # one job: the same mirror group
    assert mirrored(tmp_path, 0, "step_1") is False and mirrored(tmp_path, 1, "step_1") is True
    for checkpoint_id in ("step_2", "step_3"):
        assert mirrored(tmp_path, 0, checkpoint_id) is True
        assert mirrored(tmp_path, 1, checkpoint_id) is True
        assert len(mirror_markers(tmp_path, 1, checkpoint_id)) == 1


def test_a_vetoed_overwrite_leaves_the_committed_checkpoint_restorable_from_memory(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=())
    run_ranks(save_then_fail_an_overwrite, 2, tmp_path, config, SMALL)
    # The failed save never happened: no node keeps a part of it as evidence of a newer commit.
    assert not list((tmp_path / "mem").glob("*/step_1/*/parts/*.json"))[2:], "only step_1's own"
    run_ranks(check_latest, 2, tmp_path, config, (0, 1), "step_1")
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "step_1", ("memory", 1), SMALL)
    shutil.rmtree(memory_root(tmp_path, 0))  # and from the mirror, once node 0 is lost
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "step_1", ("memory", 1), SMALL)


def test_overwrites_back_to_back_keep_mirroring_the_newest_generation(tmp_path: Path) -> None:
    config = mirror_config(tmp_path, lower=(), timeout="30s")
    run_ranks(overwrite_back_to_back, 2, tmp_path, config, 4 * BIG)
    committed = Manifest.from_json(
        (memory_root(tmp_path, 0) / marker_path("latest")).read_bytes(), where="marker"
    ).generation
    for node in (0, 1):
        (marker,) = mirror_markers(tmp_path, 1 - node, "latest")
        assert marker.parent.name == committed, "the newest generation is mirrored, only it"
        assert len(mirror_markers(tmp_path, 1 - node, "big")) == 1
    shutil.rmtree(memory_root(tmp_path, 1))
    run_ranks(load_step, 2, tmp_path, config, (0, 1), "latest", ("memory", 3), 2000)
