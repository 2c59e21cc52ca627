"""The files a rank sends in a mirror round are mapped only for the round: the mappings go once the
round has ended (after its end, off the path of everyone waiting for it), never later."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.mirror_jobs import become, mirror_config, mirror_markers, shard_state
from tests.process_files import mapped_inodes, own_checkpoint_files
from tests.workers import run_ranks
from tierstore import TieredWriter


def _save_and_check_released(rank: int, world: int, root: Path) -> None:
    become(rank)
    writer = TieredWriter(mirror_config(root, lower=("local",)), node=rank)
    for step in (1, 2):
        dcp.save(shard_state(rank, step, 400_000), storage_writer=writer, checkpoint_id=f"step_{step}")
        assert writer.wait_mirrored(60), f"rank {rank}: step_{step} not mirrored"
        own = own_checkpoint_files(root, rank, f"step_{step}")
        assert own, f"rank {rank}: no own files of step_{step} found"
        deadline = time.monotonic() + 10
        while (still := own.keys() & mapped_inodes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not still, f"rank {rank}: sent files still mapped: {[own[i] for i in still]}"
    dist.barrier()
    writer.close()


def test_the_files_a_round_sent_are_unmapped_after_it(tmp_path: Path) -> None:
    run_ranks(_save_and_check_released, 2, tmp_path, tmp_path)
    for node in (0, 1):
        assert len(mirror_markers(tmp_path, node, "step_2")) == 1, f"node {node} holds no mirror"
