"""The peer mirror across a fork (a data-loader worker, a helper the trainer forks right after a save):
the child has no mirror rounds of its own to count or wait for, and the parent's rounds go on.

Started as an adversarial review's probe of the per-process mirror workers (tierstore._platform.runtime): a
plain module dict would hand the child the parent's round count, and a wait there for rounds that
never run in the child.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.forked import in_forked_child
from tests.mirror_jobs import become, memory_root, mirror_config, mirror_markers, shard_state
from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore.dcp.mirror.rounds import worker_for


def _fork_after_each_save(rank: int, world: int, root: Path) -> None:
    become(rank)
    writer = TieredWriter(mirror_config(root, lower=("local",)), node=rank)
    for step in (1, 2):
        dcp.save(shard_state(rank, step, 20_000), storage_writer=writer, checkpoint_id=f"step_{step}")

        def child() -> int:  # the parent's round may still be running: none of it is here
            worker = worker_for(writer.tier)
            if worker.submitted != 0:
                return 3
            return 0 if worker.wait_idle(timeout_s=5) else 4

        status = in_forked_child(child, deadline=30)
        assert os.WIFEXITED(status), f"rank {rank}: the forked child hung"
        assert os.WEXITSTATUS(status) == 0, (
            f"rank {rank}: the forked child {'saw' if os.WEXITSTATUS(status) == 3 else 'waited for'}"
            " the parent's mirror rounds"
        )
        assert writer.wait_mirrored(60), f"rank {rank}: the parent's round stopped at the fork"
        assert worker_for(writer.tier).submitted == step
    dist.barrier()  # both ranks' rounds ended: every mirror is in place
    writer.close()


def test_a_forked_child_has_no_mirror_rounds_and_the_parents_go_on(tmp_path: Path) -> None:
    run_ranks(_fork_after_each_save, 2, tmp_path, tmp_path)
    for node in (0, 1):
        assert memory_root(tmp_path, node).is_dir()
        assert len(mirror_markers(tmp_path, node, "step_2")) == 1, f"node {node} holds no mirror"
