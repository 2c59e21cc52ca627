"""A trainer forks a helper that exits normally (``sys.exit``: atexit handlers and inherited
finalizers run there) while a memory tier holds its staging buffers and a save sits in its commit
gate. Prints what the child's exit removed of the parent's files (nothing, if it is right), then
whether the parent's next save still works. Run by tests/guarantees/test_fork_exit.py."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter
from tierstore.config import config_from_dict


def files_under(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def main(root: str) -> None:
    config = config_from_dict({"tiers": [{"name": "memory", "type": "memory", "path": root + "/mem/{node}"}]})
    in_gate, go = threading.Event(), threading.Event()

    def gate(_view: Any) -> None:
        if not go.is_set():
            in_gate.set()
            go.wait(30)

    writer = TieredWriter(config, commit_gate=gate)
    go.set()
    for step in (1, 2):  # the second save stages into a slab; a spare is prepared after it
        dcp.async_save(
            {"w": torch.full((256, 256), float(step))}, storage_writer=writer, checkpoint_id=f"step_{step}"
        ).result()
    writer._stager_for_this_process().wait_until_prepared()
    go.clear()
    pending = dcp.async_save(
        {"w": torch.full((256, 256), 3.0)}, storage_writer=writer, checkpoint_id="step_3"
    )
    assert in_gate.wait(30)  # step_3 is planned: its write record and generation exist
    before = files_under(root)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    os.waitpid(pid, 0)
    removed = sorted(set(before) - set(files_under(root)))
    go.set()
    pending.result()
    dcp.async_save({"w": torch.full((256, 256), 4.0)}, storage_writer=writer, checkpoint_id="step_4").result()
    target = {"w": torch.zeros(256, 256)}
    dcp.load(target, storage_reader=TieredReader(config), checkpoint_id="step_4")
    print(
        json.dumps(
            {"removed": removed, "loaded": bool(torch.equal(target["w"], torch.full((256, 256), 4.0)))}
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
